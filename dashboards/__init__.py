"""Grafana dashboards for pdwatch, built with grafana-foundation-sdk (Grafana 11.6 schema).

`pdwatch.dashboards.render` turns the builders into the JSON committed under
`dashboards/generated/`; `pdwatch.dashboards.push` sends them to a Grafana server;
`pdwatch dashboards generate|push` runs either from the command line.
"""
