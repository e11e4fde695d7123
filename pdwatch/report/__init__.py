"""`pdwatch report`: an incident report (HTML with its plots embedded, the PNGs, report.json).

One job per module: `model` (the incident, whatever its source), `times` (reading
and printing times), `sources` (Prometheus over a range, or a sidecar's history;
the diagnosis as the classifier said it), `plots` (matplotlib figures), `html`
(the Jinja2 template `templates/report.html.j2`), `write` (the whole report) and
`cli` (the command line).
"""
