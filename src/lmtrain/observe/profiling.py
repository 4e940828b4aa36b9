"""torch.profiler on demand: a running job profiles its next N steps on the ranks asked.

``lmlaunch profile RUN --steps N --ranks 0,1`` writes ``profile-request.json`` into the run
directory (atomically): ``{"id", "attempt", "steps", "ranks"}`` (``ranks`` null: every rank; a
request of an earlier attempt is not served again). Every rank
looks for it at its logging steps, as the stop agreement is polled: one ``stat`` of a small file,
no signal, no collective. A rank asked, seeing an id it has not served, profiles its next
``steps`` optimizer steps with ``torch.profiler`` (CPU, and CUDA on a GPU), then writes into
``logs/attempt-<N>/profile-<id>/``:

- ``trace-rank-<R>.json``: the Chrome/Perfetto trace (open it in https://ui.perfetto.dev or
  chrome://tracing);
- ``top-rank-<R>.json``: ``{"rank", "node", "steps", "from_step", "to_step", "ops": [{"name",
  "self_s", "total_s", "calls"}]}``, the operators by self time (CUDA time on a GPU), written last
  and atomically: the command waits for it.

The spec's ``profile`` section asks for the same from a step on (``start_step``), without the
command: its id is ``spec-<start_step>``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from lmcore.atomic import write_json
from lmtrain.observe.profile_request import RequestPoll, read_request

__all__ = ["MAX_STEPS", "ProfileOnDemand", "read_request", "top_ops"]

log = logging.getLogger(__name__)

TOP_OPS = 25
MAX_STEPS = 1000  # the most steps one request profiles (the spec's and the command's bound): the ranks asked
# stop the profiler, export the trace and sum the operators inside a step, while the others wait


class ProfileOnDemand(pl.Callback):
    """Polls the run's profile request at logging steps; profiles this rank's next steps when asked."""

    def __init__(self, request_path: Path, out_dir: Any, *, attempt: int, rank: int, node: str,
                 log_every_n_steps: int, cuda: bool, spec: Any = None) -> None:
        self.request_path, self.out_dir, self.attempt = Path(request_path), out_dir, attempt  # out_dir(id) -> Path
        self.rank, self.node, self.every, self.cuda = rank, node, log_every_n_steps, cuda
        self.spec = spec  # the spec's profile section (start_step, steps, ranks), or None
        self.poll = RequestPoll(self.request_path, attempt=attempt, rank=rank)
        self.served = self.poll.served
        self.active: dict[str, Any] | None = None
        self._polled_step: int | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if self.active is not None:
            if step != self.active["last_step"]:
                self.active["last_step"] = step
                self.active["profiler"].step()
                if step - self.active["from_step"] >= self.active["steps"]:
                    self._finish(step)
            return
        if step != self._polled_step and (step % self.every == 0 or (self.spec is not None and step == self.spec.start_step)):
            self._polled_step = step  # once a step (micro batches share it)
            request = self._asked(step)
            if request is not None:
                self._start(request, step)

    def _asked(self, step: int) -> dict[str, Any] | None:
        return self.poll.asked(step, self.spec)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        spec = self.spec
        if spec is not None and trainer.global_step > spec.start_step:
            self.served.add(f"spec-{spec.start_step}")  # a resumed attempt past the window: profiled before

    def _start(self, request: dict[str, Any], step: int) -> None:
        from torch.profiler import ProfilerActivity, profile

        steps = min(max(int(request["steps"]), 1), MAX_STEPS)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        try:
            profiler = profile(activities=activities, record_shapes=False, with_stack=False)
            profiler.start()
        except Exception as exc:  # a profiler already running (another tool), a missing CUPTI: said, not raised
            log.warning("could not start torch.profiler for request %s: %s", request["id"], exc)
            return
        self.active = {"id": request["id"], "steps": steps, "from_step": step, "last_step": step, "profiler": profiler}
        log.info("profiling steps %d-%d for request %s", step + 1, step + steps, request["id"])

    def _finish(self, step: int) -> None:
        active, self.active = self.active, None
        assert active is not None
        out, profiler = Path(self.out_dir(active["id"])), active["profiler"]
        try:
            profiler.stop()
            out.mkdir(parents=True, exist_ok=True)
            profiler.export_chrome_trace(str(out / f"trace-rank-{self.rank}.json"))
            write_json(out / f"top-rank-{self.rank}.json", {
                "rank": self.rank, "node": self.node, "steps": active["steps"], "from_step": active["from_step"] + 1,
                "to_step": step, "ops": top_ops(profiler, cuda=self.cuda)})
            log.info("profile %s written: %s", active["id"], out)
        except Exception as exc:  # a profile never costs the run
            log.warning("could not write profile %s: %s", active["id"], exc)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.active is not None:  # the run ended inside the window: what was recorded
            self._finish(trainer.global_step)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "fit")  # Lightning runs no callback teardown when the fit raises


def top_ops(profiler: Any, *, cuda: bool, n: int = TOP_OPS) -> list[dict[str, Any]]:
    """The operators by self time (the device's on a GPU), the largest first. Ranges that code
    names (``record_function``: Lightning's ``Optimizer.step#AdamW.step`` holds the whole
    forward and backward of its closure) are left out: on a GPU their self time is the span of
    every kernel launched inside, not work of their own (seen on an H100: the step's 68 ms)."""
    rows = []
    for e in profiler.key_averages():
        if getattr(e, "is_user_annotation", False):
            continue
        self_us = e.self_device_time_total if cuda else e.self_cpu_time_total
        total_us = e.device_time_total if cuda else e.cpu_time_total
        rows.append({"name": e.key, "self_s": self_us / 1e6, "total_s": total_us / 1e6, "calls": int(e.count)})
    rows.sort(key=lambda r: -r["self_s"])
    return rows[:n]
