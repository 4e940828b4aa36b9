"""The long-running loopback servers of the login node: the Prometheus exporter of every run's
metrics (and its textfile form), the Grafana dashboard's JSON, the --listen address and the
bearer token. The web dashboard's page lives in ``launcher/web``.

May import: lmcore, launcher.runs, launcher.monitor. Not submission, doctor, search or commands.
"""
