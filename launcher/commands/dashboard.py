"""lmlaunch dashboard [--listen HOST:PORT]: a live, read-only web page of the user's runs.

The runs table as `status` shows it, and the selected run's loss and throughput curves, its
attempts (why each ended, preemptions and requeues), each rank's compute per step (a slow rank in
red) and its history notes (memory planned against held, stragglers), refreshed every 2 s without
reloading (launcher/web: the page, its script, Chart.js 4 vendored with its license).

A login node is shared: the page binds 127.0.0.1 unless --listen says otherwise (reach it through
`ssh -L`), and every page and API request needs the token printed at start (in the URL, as
Jupyter's); a request without it gets 403. Only GET is answered: nothing here can cancel or
change a run, and nothing is written into a run directory. A thread reads the runs again and
again (launcher.serve.exporter.Snapshots); a request is answered from the newest reading.
"""

from __future__ import annotations

import argparse
import hmac
import json
import math
import secrets
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from launcher.context import Context

DEFAULT_LISTEN = "127.0.0.1:9768"
WEB = Path(__file__).resolve().parents[1] / "web"
STATIC = {"/chart.umd.min.js": "application/javascript", "/dashboard.js": "application/javascript"}
HISTORY_CACHE_S = 10.0  # a run's history (one sacct call) is read again after this long


def finite(value: Any) -> Any:
    """``value`` with NaN and infinities as None: a diverged loss is valid JSON for the browser."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


def to_json(value: Any) -> bytes:
    return json.dumps(finite(value), allow_nan=False).encode()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", default=DEFAULT_LISTEN, metavar="HOST:PORT",
                   help=f"where to listen (default {DEFAULT_LISTEN}; a login node is shared: keep 127.0.0.1 and "
                        "reach it through ssh -L)")
    p.add_argument("--refresh", type=float, default=5.0, metavar="SECONDS",
                   help="pause between two readings of the runs (default 5; each asks squeue once)")
    p.add_argument("--seconds", type=float, default=None, help=argparse.SUPPRESS)  # stop after (tests)


class Pages:
    """What the server answers: the page, its static files, the runs and one run (read-only)."""

    def __init__(self, environ: dict[str, str] | None, token: str, refresh_s: float) -> None:
        from launcher.serve.exporter import Snapshots

        self.environ, self.token = environ, token
        self.snapshots = Snapshots(self._read_runs, pause_s=refresh_s)
        self._histories: dict[str, tuple[float, dict[str, Any]]] = {}
        self._lock = threading.Lock()

    def _read_runs(self) -> bytes:
        from launcher.monitor import status_rows as monitor
        from launcher.runs import registry as runs

        records = runs.list_records(self.environ)
        rows, view = monitor.gather_status(records, environ=self.environ)
        return to_json({"runs": [r.to_dict() for r in rows], "slurm_reachable": view.reachable, "time": time.time()})

    def runs(self) -> dict[str, Any]:
        got = self.snapshots.answer()  # None: the first reading is not done yet
        body = got[0] if got is not None else b""
        return json.loads(body) if body else {"runs": [], "slurm_reachable": False, "time": None}

    def run(self, name: str) -> dict[str, Any] | None:
        """One run's curves, attempts, ranks and notes; None for a run the registry does not know."""
        from launcher.commands.history import load_history
        from launcher.monitor import run_files
        from launcher.runs import registry as runs
        from lmcore import jsonlines
        from lmcore.run import rundir

        row = next((r for r in self.runs()["runs"] if r["name"] == name), None)
        if row is None:
            return None
        rec = runs.find_run(name, self.environ)
        with self._lock:
            cached = self._histories.get(name)
            if cached is None or time.monotonic() - cached[0] > HISTORY_CACHE_S:
                h = load_history(rec)
                cached = (time.monotonic(), {"attempts": [a.to_dict() for a in h.attempts], "notes": h.notes,
                                             "eval": h.eval, "gpu_hours": h.gpu_hours,
                                             "train_gpu_hours": h.train_gpu_hours})
                self._histories[name] = cached
        run_dir = Path(rec.run_dir)
        beats = list(jsonlines.read_jsonl(rundir.RunLayout.of(run_dir).heartbeat))
        steps = [{"step": b.get("step"), "loss": b.get("loss"), "tokens_per_s": b.get("tokens_per_s")}
                 for b in beats if b.get("event") == "step"]
        val = [{"step": b.get("step"), "val_loss": b.get("val_loss")} for b in beats if b.get("event") == "val"]
        summary = run_files.read_rank_times(run_dir) if row["group"] == "running" else None
        if summary is not None and summary.get("attempt") != row["attempt"]:
            summary = None  # an earlier attempt's ranks: not this one's
        ranks = [{"rank": int(k), "node": v.get("node"), "forward": v.get("forward"), "slow": bool(v.get("slow"))}
                 for k, v in sorted((summary or {}).get("ranks", {}).items(), key=lambda kv: int(kv[0]))]
        try:  # whether an evaluator runs alongside (an empty evaluation chart says which it is)
            alongside: bool | None = bool(json.loads(rundir.RunLayout.of(run_dir).plan.read_text()).get("evaluator"))
        except (OSError, ValueError, AttributeError):
            alongside = None
        return {**row, "steps": steps, "val": val, "ranks": ranks, "eval_alongside": alongside, **cached[1]}

    def allowed(self, query: str) -> bool:
        given = (parse_qs(query).get("token") or [""])[0]
        return hmac.compare_digest(given.encode(), self.token.encode())


def _handler(pages: Pages) -> type:
    from http.server import BaseHTTPRequestHandler

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, body: bytes, kind: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("Content-Security-Policy", "default-src 'self'; style-src 'self' 'unsafe-inline'")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            url = urlsplit(self.path)
            if url.path in STATIC:  # the page's own scripts: nothing of the user's in them
                self._send(200, (WEB / url.path.lstrip("/")).read_bytes(), STATIC[url.path])
                return
            if not pages.allowed(url.query):
                self._send(403, b"403: this page needs the token `lmlaunch dashboard` printed (in the URL)\n",
                           "text/plain; charset=utf-8")
                return
            if url.path == "/":
                self._send(200, (WEB / "dashboard.html").read_bytes(), "text/html; charset=utf-8")
            elif url.path == "/api/runs":
                self._send(200, to_json(pages.runs()), "application/json")
            elif url.path.startswith("/api/run/"):
                try:
                    found = pages.run(unquote(url.path.removeprefix("/api/run/")))
                except Exception as exc:  # a run removed between two readings, a damaged file: said, not a dropped line
                    self._send(500, to_json({"error": f"{type(exc).__name__}: {exc}"}), "application/json")
                    return
                if found is None:
                    self._send(404, b'{"error": "no such run"}', "application/json")
                else:
                    self._send(200, to_json(found), "application/json")
            else:
                self._send(404, b"404\n", "text/plain; charset=utf-8")

        def _refuse(self) -> None:
            self._send(405, b"405: the dashboard is read-only\n", "text/plain; charset=utf-8")

        do_POST = do_PUT = do_DELETE = do_PATCH = _refuse

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler


def run(args: argparse.Namespace, ctx: Context) -> int:
    from launcher.remote import warm
    from launcher.serve import http_serve

    host, port = http_serve.parse_listen(args.listen)
    if (warning := http_serve.exposure(host, "dashboard")) is not None:
        ctx.err(warning)
    pages = Pages(ctx.environ or None, secrets.token_urlsafe(24), http_serve.check_refresh(args.refresh))
    server = http_serve.bind(host, port, _handler(pages), what="dashboard")
    pages.snapshots.start()
    ctx.out(f"dashboard: http://{host}:{port}/?token={pages.token}  (read-only; Ctrl-C stops)")
    with warm.answering(ctx):  # forwarded status/logs/history answered without a start (launcher.remote.warm)
        http_serve.serve_until(server, args.seconds, then=pages.snapshots.stop)
    return 0
