"""A real Prometheus server for a test (Debian's `prometheus`, installed by scripts/setup.sh):
started on a loopback port with a 1 s scrape of the given targets, queried through its HTTP API,
stopped at the end. tests/unit/test_metrics.py and tests/integration/test_metrics_on_cluster.py."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

from waiting import HANG_S


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def prometheus(targets: list[str], where: Path, token_file: Path | None = None,
               paths: tuple[tuple[str, str], ...] = ()) -> Iterator[tuple[subprocess.Popen, Callable[[str], list]]]:
    """(the server's process, ``query(expr)`` -> the instant vector's results, [] while it does not
    answer yet); its log is ``where/prometheus.log``. ``paths``: more scrape jobs, (target, metrics
    path) each (slurmctld serves its metrics on several paths of one port)."""
    binary = shutil.which("prometheus")
    assert binary, "Debian's prometheus is missing: scripts/setup.sh installs it (as root)"
    web = free_port()
    config = where / "prometheus.yml"
    auth = f"    authorization: {{credentials_file: {json.dumps(str(token_file))}}}\n" if token_file else ""
    more = "".join(f"  - job_name: extra{i}\n    metrics_path: {json.dumps(path)}\n"
                   f"    static_configs: [{{targets: [{json.dumps(target)}]}}]\n" for i, (target, path) in enumerate(paths))
    config.write_text("global: {scrape_interval: 1s}\nscrape_configs:\n  - job_name: lmlaunch\n"
                      f"    static_configs: [{{targets: {json.dumps(targets)}}}]\n" + auth + more)
    server = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={where / 'tsdb'}",
                               f"--web.listen-address=127.0.0.1:{web}"], stdout=subprocess.DEVNULL,
                              stderr=open(where / "prometheus.log", "w"))

    def query(expr: str) -> list:
        url = f"http://127.0.0.1:{web}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            with urllib.request.urlopen(url, timeout=HANG_S) as r:
                answer = json.loads(r.read())
        except OSError:
            return []
        assert answer["status"] == "success", (expr, answer)
        return answer["data"]["result"]

    try:
        yield server, query
    finally:
        server.terminate()
        server.wait(timeout=HANG_S)
