"""Webhook messages about the run (spec ``notify``), sent by rank 0 from a background thread.

Slack-compatible: a JSON body with ``text``, plus ``event``, ``run``, ``attempt``, ``job_id`` and the
event's facts. Every delivery has a timeout and bounded retries; :meth:`Notifier.send` only puts
the message on a queue, so an unreachable webhook never slows or stops training. At the end of an
attempt :meth:`Notifier.close` waits a bounded time for what is queued, then gives up.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lmcore.job.spec import NotifySpec

log = logging.getLogger(__name__)
CLOSE_WAIT_S = 10.0  # at the end of an attempt, at most this long for queued messages


def notify_settings(notify: NotifySpec | Mapping[str, Any] | None) -> NotifySpec:
    """The spec's ``notify`` section, typed (a section given as a dict is validated again; none:
    no webhooks)."""
    if isinstance(notify, NotifySpec):
        return notify
    return NotifySpec.model_validate(dict(notify or {}))


def webhook_urls(notify: NotifySpec | Mapping[str, Any], environ: Mapping[str, str]) -> list[str]:
    """The URLs of the spec's webhooks (``url_env`` read from the environment; unset: left out)."""
    out = []
    for hook in notify_settings(notify).webhooks:
        url = hook.url or environ.get(hook.url_env or "", "")
        if url:
            out.append(url)
        else:
            log.warning("notify: %s is not set in this task's environment; that webhook is skipped", hook.url_env)
    return out


def post(url: str, body: Mapping[str, Any], *, timeout_s: float, retries: int) -> str | None:
    """Deliver one message; None when delivered, else the last error."""
    data = json.dumps(body).encode()
    error = None
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(min(30.0, 2.0 ** (attempt - 1)))
        try:
            req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                if 200 <= resp.status < 300:
                    return None
                error = f"HTTP {resp.status}"
        except (urllib.error.URLError, OSError, ValueError) as exc:
            error = str(getattr(exc, "reason", None) or exc)
    return error


class Notifier:
    """Rank 0's sender for one attempt (other ranks get one that sends nothing)."""

    def __init__(self, notify: NotifySpec | Mapping[str, Any] | None, *, run: str, attempt: int,
                 job_id: str | None, enabled: bool, environ: Mapping[str, str] | None = None) -> None:
        settings = notify_settings(notify)
        self.events = set(settings.events)
        self.base = {"run": run, "attempt": attempt, "job_id": job_id}
        self.urls = webhook_urls(settings, os.environ if environ is None else environ) if enabled else []
        self.timeout_s, self.retries = settings.timeout_s, settings.retries
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        if self.urls:
            self._thread = threading.Thread(target=self._deliver, name="lmtrain-notify", daemon=True)
            self._thread.start()

    def send(self, event: str, text: str, **facts: Any) -> None:
        if self._thread is not None and event in self.events:
            self._queue.put({"text": f"[{self.base['run']}] {text}", "event": event, **self.base, **facts,
                             "time": time.time()})

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join(timeout=wait_s)
        if self._thread.is_alive():
            log.warning("notify: messages still undelivered after %.0f s; giving up on them", wait_s)

    def _deliver(self) -> None:
        while True:
            body = self._queue.get()
            if body is None:
                return
            for url in self.urls:
                error = post(url, body, timeout_s=self.timeout_s, retries=self.retries)
                if error is not None:
                    log.warning("notify: %s could not be delivered to a webhook: %s", body["event"], error)


def last_lines(attempt_dir: Path, n: int = 20) -> str:
    """The last lines of the first rank whose log shows an error (else of the first rank's)."""
    from lmcore.run.rank_logs import ranks_texts

    texts = list(ranks_texts(attempt_dir).values())
    failing = next((t for t in texts if any("Traceback" in x or "Error" in x for x in t)), texts[0] if texts else [])
    return "\n".join(failing[-n:])


def goodput(ledger: Sequence[Mapping[str, Any]], beats: Sequence[Mapping[str, Any]], now: float) -> float | None:
    """Training time / allocated time over the run's attempts: each attempt's first to last step
    line over its start to end line (as `lmlaunch history` without accounting's figures)."""
    starts = {e["attempt"]: float(e["time"]) for e in ledger if e.get("event") == "start" and e.get("time")}
    ends = {e["attempt"]: float(e["time"]) for e in ledger if e.get("event") == "end" and e.get("time")}
    spans: dict[Any, list[float]] = {}
    for b in beats:
        if b.get("event") in ("start", "step") and b.get("time"):
            spans.setdefault(b.get("attempt"), []).append(float(b["time"]))
    alloc = sum(ends.get(n, now) - t for n, t in starts.items())
    train = sum(max(ts) - min(ts) for n, ts in spans.items() if n in starts and len(ts) > 1)
    return min(1.0, train / alloc) if alloc > 0 else None


def notify_end(notifier: Any, plan: Any, outcome: Any, attempt: int) -> None:
    """The webhook messages of how this attempt ended."""
    from lmcore.jsonlines import read_jsonl
    from lmcore.run.rundir import RunLayout

    step, reason, detail = outcome.end_step, outcome.reason, outcome.detail or ""
    facts = {"reason": reason, "end_step": step, "detail": detail[:500]}
    if reason in ("preempted", "timeout"):
        notifier.send("preempted", f"attempt {attempt} {reason} at step {step}", **facts)
    elif reason == "hang":
        notifier.send("hang", f"attempt {attempt} hung at step {step}: {detail[:300]}", **facts)
    elif reason == "completed":
        beats = read_jsonl(plan.paths.heartbeat)
        losses = [b["loss"] for b in beats if b.get("event") == "step" and isinstance(b.get("loss"), (int, float))]
        g = goodput(read_jsonl(plan.paths.ledger), beats, time.time())
        loss_text = f"{losses[-1]:.4f}" if losses else "?"
        notifier.send("completed", f"completed at step {step}: loss {loss_text}, goodput "
                      f"{'?' if g is None else f'{g:.2f}'}", **facts, loss=losses[-1] if losses else None, goodput=g)
    if outcome.requeued and getattr(outcome, "action", None) == "restart":  # lmtrain.preemption: in the allocation
        notifier.send("requeued", f"restarted in place after {reason} at step {step} (the same job and nodes, no "
                      "queue wait): the next attempt resumes from the newest checkpoint", **facts, restart="in_place")
    elif outcome.requeued:
        notifier.send("requeued", f"requeued after {reason}: the next attempt resumes from the newest checkpoint",
                      **facts)
    elif reason not in ("completed", "preempted", "timeout", "cancelled", "hang"):
        notifier.send("failed", f"attempt {attempt} failed ({reason}) at step {step}: {detail[:300]}",
                      **facts, log_tail=last_lines(RunLayout.of_plan(plan).attempt_logs(attempt)))
