"""lmlaunch notify-test job.yaml [overrides...]: send a test message to each of the spec's webhooks."""

from __future__ import annotations

import argparse
import os

from launcher.commands import add_spec_arguments
from launcher.context import Context
from launcher.planning.resolve import resolve
from lmcore.errors import ExitCode, UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_spec_arguments(p, "notify.retries=0")


def run(args: argparse.Namespace, ctx: Context) -> int:
    from lmtrain.observe.notify import post  # urllib only: no torch

    r = resolve(args.spec, args.overrides, args.cluster, ctx.environ, python=ctx.python, force=True)
    notify = r.plan.spec.get("notify") or {}
    hooks = notify.get("webhooks") or []
    if not hooks:
        raise UserError(f"{args.spec}: no notify.webhooks to test")
    environ = ctx.environ or os.environ
    failed = 0
    for i, hook in enumerate(hooks, 1):
        url = hook.get("url") or environ.get(hook.get("url_env") or "", "")
        where = hook.get("url") or f"${hook.get('url_env')}"
        if not url:
            ctx.out(f"webhook {i} ({where}): not set in this shell; the tasks would skip it")
            failed += 1
            continue
        body = {"text": f"[{r.plan.run_name}] lmlaunch notify-test: this webhook will receive {', '.join(notify['events'])}",
                "event": "test", "run": r.plan.run_name}
        error = post(url, body, timeout_s=float(notify["timeout_s"]), retries=int(notify["retries"]))
        ctx.out(f"webhook {i} ({where}): " + ("delivered" if error is None else f"failed: {error}"))
        failed += error is not None
    return ExitCode.FAILURE if failed else 0
