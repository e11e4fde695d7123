"""Failure-family diagnosis (contract section 8): facts in, verdicts out.

`facts` holds the shapes; `from_evaluation` and `from_prometheus` gather them
(one sidecar's latest evaluation, or a whole cluster through Prometheus);
`classify` reasons over them the same way for both.
"""
