"""lmlaunch metrics serve [--listen HOST:PORT] | metrics write DIR | metrics dashboard -o FILE [--force]

The user's runs as Prometheus metrics (launcher.serve.exporter): `serve` answers Prometheus' scrapes on
the login node (127.0.0.1 unless --listen says otherwise: a login node is shared); `write` leaves
one atomic `.prom` file for node_exporter's textfile collector (run it from cron); `dashboard`
writes a Grafana dashboard of those series (launcher.serve.grafana).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from launcher.context import Context
from lmcore.errors import UserError

DEFAULT_LISTEN = "127.0.0.1:9767"
TEXTFILE = "lmlaunch.prom"
TOKEN_FILE = "metrics.token"  # under $LMLAUNCH_HOME


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="metrics_command", metavar="ACTION")
    serve = sub.add_parser("serve", help="answer Prometheus' scrapes with every run's metrics")
    serve.add_argument("--listen", default=DEFAULT_LISTEN, metavar="HOST:PORT",
                       help=f"where to listen (default {DEFAULT_LISTEN}; a login node is shared: keep 127.0.0.1 "
                            "and reach it through ssh -L, or a site's own proxy)")
    serve.add_argument("--refresh", type=float, default=5.0, metavar="SECONDS",
                       help="pause between two readings of the runs (default 5; each asks squeue once); a scrape is "
                            "answered from the newest")
    serve.add_argument("--token-file", metavar="FILE", default=None,
                       help=f"scrapes must carry `Authorization: Bearer` with the token in FILE (made, mode 0600, when "
                            f"missing; Prometheus: authorization: {{credentials_file: FILE}}); default "
                            f"$LMLAUNCH_HOME/{TOKEN_FILE}: a login node is shared, and its other users reach 127.0.0.1 too")
    serve.add_argument("--no-token", action="store_true",
                       help="answer any scrape (a site whose proxy in front does the checking)")
    serve.add_argument("--seconds", type=float, default=None, help=argparse.SUPPRESS)  # stop after (tests)
    write = sub.add_parser("write", help=f"write every run's metrics to DIR/{TEXTFILE} (node_exporter's textfile "
                                         "collector), atomically")
    write.add_argument("dir", metavar="DIR", help="the textfile collector's directory (--collector.textfile.directory)")
    board = sub.add_parser("dashboard", help="write a Grafana dashboard (JSON) of these metrics, to import or provision")
    board.add_argument("-o", "--output", required=True, metavar="FILE", help="where to write the dashboard's JSON")
    board.add_argument("--controller-metrics", choices=("auto", "yes", "no"), default="auto",
                       help="panels of slurmctld's own series (queue, node states, requeues): auto = when the "
                            "cluster's MetricsType is metrics/openmetrics (SLURM 26.05 here)")
    board.add_argument("--force", action="store_true", help="replace FILE if it exists")


def run(args: argparse.Namespace, ctx: Context) -> int:
    if args.metrics_command == "dashboard":
        return _dashboard(Path(args.output), force=args.force, ctx=ctx, controller=args.controller_metrics)
    from prometheus_client import CollectorRegistry

    from launcher.serve.exporter import RunsCollector

    registry = CollectorRegistry(auto_describe=False)
    registry.register(RunsCollector(ctx.environ or None))
    if args.metrics_command == "write":
        return _write(registry, Path(args.dir), ctx)
    if args.metrics_command != "serve":
        raise UserError("lmlaunch metrics: say serve, write or dashboard (`lmlaunch metrics --help`)")
    from launcher.remote import warm
    from launcher.serve import http_serve

    host, port = http_serve.parse_listen(args.listen)
    if (warning := http_serve.exposure(host, "exporter")) is not None:
        ctx.err(warning)
    token, said = _token(args, ctx)
    server = _start(registry, host, port, refresh_s=http_serve.check_refresh(args.refresh), token=token)
    ctx.out(f"serving the runs' metrics on http://{host}:{port}/metrics (Ctrl-C stops){said}")
    with warm.answering(ctx):  # forwarded status/logs/history answered without a start (launcher.remote.warm)
        http_serve.serve_until(server, args.seconds)
    return 0


def _token(args: argparse.Namespace, ctx: Context) -> tuple[str | None, str]:
    """The scrape token (None: --no-token) and what to say about it."""
    from launcher.runs.home import lmlaunch_home
    from launcher.serve import http_serve

    if args.no_token:
        if args.token_file:
            raise UserError("lmlaunch metrics serve: --token-file and --no-token exclude each other")
        ctx.err("warning: --no-token: every user who reaches the address reads every run's metrics")
        return None, ""
    path = Path(args.token_file).expanduser() if args.token_file else lmlaunch_home(ctx.environ or None) / TOKEN_FILE
    if not args.token_file:
        path.parent.mkdir(parents=True, exist_ok=True)
    token, made = http_serve.bearer_token(path)
    return token, (f"; scrapes carry `Authorization: Bearer` with the token {'made in' if made else 'in'} {path} "
                   f"(Prometheus: authorization: {{credentials_file: {path}}})")


def _start(registry, host: str, port: int, *, refresh_s: float, token: str | None = None):
    """An HTTP server answering GET /metrics with the newest snapshot (launcher.serve.exporter.Snapshots)."""
    from http.server import BaseHTTPRequestHandler

    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    from launcher.serve import http_serve
    from launcher.serve.exporter import Snapshots, with_age

    snapshots = Snapshots(lambda: generate_latest(registry), pause_s=refresh_s)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] not in ("/metrics", "/"):
                self.send_error(404, "only /metrics is here")
                return
            if not http_serve.authorized(self.headers.get("Authorization"), token):
                self.send_response(401)
                self.send_header("WWW-Authenticate", 'Bearer realm="lmlaunch metrics"')
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            got = snapshots.answer()
            if got is None:  # the first reading of the runs is not done yet
                self.send_response(503)
                self.send_header("Retry-After", "5")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            body = with_age(*got)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass  # one line per scrape would fill the terminal

    server = http_serve.bind(host, port, Handler, what="exporter")
    snapshots.start()
    return server


def _write(registry, folder: Path, ctx: Context) -> int:
    from prometheus_client import write_to_textfile

    if not folder.is_dir():
        raise UserError(f"{folder}: not a directory (the textfile collector's --collector.textfile.directory)")
    target = folder / TEXTFILE
    try:
        write_to_textfile(str(target), registry)  # a temporary file renamed into place: atomic
    except OSError as exc:
        raise UserError(f"{target}: cannot write it: {exc.strerror or exc}") from None
    ctx.out(f"wrote {target}")
    return 0


def _dashboard(path: Path, *, force: bool, ctx: Context, controller: str = "auto") -> int:
    """The Grafana dashboard into ``path`` (atomically; an existing file only with --force), with
    the controller's panels where it serves its metrics (said either way)."""
    import json

    from launcher.serve.grafana import CONTROLLER_PATHS, dashboard
    from lmcore.atomic import write_atomic

    if path.exists() and not force:
        raise UserError(f"{path} exists: lmlaunch keeps it. Replace it with --force, or choose another file")
    if not path.parent.is_dir():
        raise UserError(f"-o {path}: the directory {path.parent} does not exist")
    served, where = _controller_metrics() if controller == "auto" else (controller == "yes", "")
    write_atomic(path, json.dumps(dashboard(controller=served), indent=2) + "\n")
    ctx.out(f"wrote {path}: import it in Grafana (Dashboards > New > Import) with your Prometheus as its data "
            "source, or drop it into a dashboards provider's folder")
    if served:
        ctx.out(f"with the controller's panels: have Prometheus scrape slurmctld{' at ' + where if where else ''} "
                f"on each of {', '.join(CONTROLLER_PATHS)} (one scrape job per metrics_path)")
    else:
        ctx.out("without the controller's panels: " + (where or "--controller-metrics no"))
    return 0


def _controller_metrics() -> tuple[bool, str]:
    """(slurmctld serves its own metrics, where it listens / why not)."""
    from lmcore.errors import SlurmUnavailable
    from lmcore.slurm import client as slurm

    try:
        cfg = slurm.config()
    except (UserError, SlurmUnavailable) as exc:
        return False, f"the cluster's configuration could not be read ({exc.message})"
    if "openmetrics" not in cfg.get("MetricsType", ""):
        return False, (f"this cluster's slurmctld (SLURM {cfg.get('SLURM_VERSION', '?')}) serves no metrics "
                       "(MetricsType is not metrics/openmetrics)")
    host = cfg.get("SlurmctldHost[0]", "").split("(")[-1].rstrip(")") or "the controller"
    return True, f"{host}:{cfg.get('SlurmctldPort', '6817')}"
