"""`python -m launcher.localcluster.inside up REQUEST`: the ordinary `up` of one cluster, run by
other_release.py inside a Debian root (where that root's SLURM is the native one). REQUEST is
JSON: the state directory and the settings. The last line printed is the result.

`... inside start REQUEST`: one daemon of a running cluster started again (cluster.start_daemon);
REQUEST: the state directory, the daemon and, for a slurmd, its node."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from launcher.localcluster import cluster
from launcher.localcluster.config import Layout, Settings
from launcher.localcluster.other_release import RESULT
from lmcore.errors import UserError


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("up", "start"):
        print("usage: python -m launcher.localcluster.inside up|start REQUEST", file=sys.stderr)
        return 2
    request = json.loads(argv[1])
    if argv[0] == "start":
        try:
            cluster.start_daemon(Layout(Path(request["state"])), request["daemon"], print, request.get("node"))
        except UserError as exc:
            print(exc.message, file=sys.stderr)
            return 1
        return 0
    s = Settings.from_json(json.dumps(request["settings"]))
    try:
        was_up = cluster.up(print, layout=Layout(Path(request["state"])), preempt_send_user_signal=s.preempt_send_user_signal,
                            ports=s.ports, system_conf=s.system_conf, accounting=s.accounting, min_job_age=s.min_job_age,
                            version=s.version, topology=s.topology or "none", gpus=s.gpus or "none")
    except UserError as exc:
        print(exc.message, file=sys.stderr)
        return 1
    print(RESULT + json.dumps({"was_up": was_up}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
