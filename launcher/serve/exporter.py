"""The user's runs as Prometheus metrics: what `lmlaunch status` shows, for a site's Prometheus and
Grafana (`lmlaunch metrics serve`) or node_exporter's textfile collector (`lmlaunch metrics write`).

One reading goes over the registry and the run directories as `status --all` does (one squeue and
at most one sacct call; a run directory whose files did not change since the last reading is not
read again: launcher/monitor/status_cache.py); `serve` answers scrapes from the newest reading
(:class:`Snapshots`). Names follow Prometheus' conventions: the ``lmlaunch_`` prefix, base units
(seconds, ratios), ``_total`` for counters; every series of a run carries its ``run`` label, and
``lmlaunch_run_info`` its job id, SLURM state and state group. What a run directory does not say
(a file missing, a damaged line skipped by the readers) is that run's missing series, never a failed
reading; nothing is written into a run directory.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from launcher.monitor import history_rows, run_files, status_rows as monitor
from launcher.runs import registry as runs
from lmcore.run import straggler_lines

# (metric, help, StatusRow attribute): a gauge per run where the row has the figure
ROW_GAUGES = (
    ("lmlaunch_run_step", "Newest optimizer step the run logged", "step"),
    ("lmlaunch_run_max_steps", "Steps the run trains in all", "max_steps"),
    ("lmlaunch_run_train_loss", "Mean training loss over the last logging window", "loss"),
    ("lmlaunch_run_tokens_per_second", "Training throughput at the last logging step", "tokens_per_s"),
    ("lmlaunch_run_mfu_ratio", "Model FLOPs utilisation at the last logging step (0..1)", "mfu"),
    ("lmlaunch_run_attempt", "The attempt now queued, running or last run (1-based)", "attempt"),
    ("lmlaunch_run_checkpoint_step", "Step of the newest complete checkpoint", "checkpoint_step"),
    ("lmlaunch_run_checkpoint_age_seconds", "Seconds since the newest complete checkpoint was written",
     "checkpoint_age_s"),
    ("lmlaunch_run_heartbeat_age_seconds", "Seconds since the run's last heartbeat line", "heartbeat_age_s"),
    ("lmlaunch_run_eta_seconds", "Estimated seconds to max_steps at the recent step rate", "eta_s"),
)


class RunsCollector:
    """A prometheus_client collector over the user's runs (``environ``: the registry and runs root
    to read, as every command takes them)."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self.environ = environ
        self.scrapes = 0

    def collect(self) -> Iterator[Metric]:
        started = time.perf_counter()
        records = runs.list_records(self.environ)
        rows, view, files = monitor.gather_status_and_files(records, environ=self.environ)
        submitted = {r.name: dict(zip(r.job_ids, r.submitted_at)) for r in records}
        yield from families(rows, [f.ledger for f in files], slurm_reachable=view.reachable,
                            submitted=[submitted.get(row.name, {}) for row in rows],
                            heartbeats=[f.heartbeat for f in files])
        yield from rank_families(rows)
        yield from eval_families(rows)
        self.scrapes += 1
        took = GaugeMetricFamily("lmlaunch_exporter_read_duration_seconds", "Seconds the newest reading of the runs took")
        took.add_metric([], time.perf_counter() - started)
        yield took


FIRST_READING_WAIT_S = 20.0  # a scrape waits this long for the first reading (Prometheus' default timeout is 10 s)


class Snapshots:
    """The exporter's answer, made ahead: a thread renders the registry again and again (each time
    reading only the run directories that changed, launcher/monitor/status_cache.py), and a scrape is
    served the newest rendering, plus its age (``lmlaunch_exporter_snapshot_age_seconds``). At
    10,000 runs a rendering takes seconds; a scrape then costs what sending the bytes costs
    (bench/metrics_scrape.py). The first scrape waits for the first rendering."""

    def __init__(self, render: Any, *, pause_s: float = 1.0) -> None:
        self.render, self.pause_s = render, pause_s  # render() -> the exposition's bytes
        self._body: bytes | None = None
        self._made_at = 0.0
        self._ready = threading.Event()
        self._stop = threading.Event()
        self.error: str | None = None
        asked = contextvars.copy_context()  # `--rest PROFILE`: the renders ask that slurmrestd too
        self._thread = threading.Thread(target=lambda: asked.run(self._run), name="lmlaunch-metrics-render", daemon=True)

    def start(self) -> Snapshots:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                body = self.render()
                self._body, self._made_at, self.error = body, time.time(), None
            except Exception as exc:  # a bad rendering keeps the last good one; the next may succeed
                self.error = f"{type(exc).__name__}: {exc}"
            self._ready.set()
            self._stop.wait(self.pause_s)

    def answer(self, first_wait_s: float = FIRST_READING_WAIT_S) -> tuple[bytes, float] | None:
        """The newest rendering and its age in seconds (NaN while none succeeded); None while the
        first reading is still under way after ``first_wait_s`` (a hung filesystem at start: the
        scrape is told to come back, never held)."""
        if not self._ready.wait(first_wait_s):
            return None
        age = max(0.0, time.time() - self._made_at) if self._body is not None else float("nan")
        return self._body or b"", age


def with_age(body: bytes, age: float) -> bytes:
    """A scrape's answer: the rendering and how old it is."""
    return body + ("# HELP lmlaunch_exporter_snapshot_age_seconds Seconds since the metrics served were read\n"
                   "# TYPE lmlaunch_exporter_snapshot_age_seconds gauge\n"
                   f"lmlaunch_exporter_snapshot_age_seconds {age}\n").encode()


# (key, metric, help, counter): one series per run from its ledger (and the registry's submit times)
LEDGER_SERIES = (
    ("started", "lmlaunch_run_attempts_started", "Attempts that started (the ledger)", True),
    ("in_place", "lmlaunch_run_restarts_in_place", "Attempts that failed and were restarted inside their allocation "
     "(same job, no queue wait; the end lines that say restart: in_place)", True),
    ("spares", "lmlaunch_run_spare_nodes_idle", "Spare nodes (resources.spare_nodes) the run's newest attempt started "
     "with idle: a restart in place swaps one in for a failed or slow node (absent: a job without spares)", False),
    ("lost", "lmlaunch_run_steps_lost", "Steps trained again after a stop: each attempt's last step less the next "
     "attempt's first (the ledger)", True),
    ("waited", "lmlaunch_run_queue_wait_seconds", "Seconds the run's attempts waited to start: from the job's "
     "submission, or from the attempt before's end line for a requeue, to the attempt's start line (the tasks' own "
     "start included; the registry and the ledger)", True),
    ("held", "lmlaunch_run_model_states_held_bytes", "The most bytes of parameters, gradients and optimizer states "
     "a rank held in the newest measured attempt (the ledger)", False),
    ("peak", "lmlaunch_run_device_peak_bytes", "The highest device memory peak of a rank in the newest measured "
     "attempt (GPU jobs; the ledger)", False),
    ("held_plan", "lmlaunch_run_model_states_planned_bytes", "One rank's parameters, gradients and optimizer "
     "states as the plan estimated them (beside ..._held_bytes)", False),
    ("peak_plan", "lmlaunch_run_device_peak_planned_bytes", "One rank's peak memory as the plan estimated it "
     "(beside ..._device_peak_bytes)", False),
    ("trained", "lmlaunch_run_training_seconds", "Seconds the run's attempts trained: from each attempt's first "
     "step to its end line (or now, while it runs)", True),
    ("allocated", "lmlaunch_run_allocated_seconds", "Seconds the run's attempts held their nodes: from each "
     "attempt's start line to its end line (or now, while it runs), and between attempts restarted in place", True),
    ("goodput", "lmlaunch_run_goodput_ratio", "Training seconds over allocated seconds, all attempts (0..1)", False),
    ("gpu_hours", "lmlaunch_run_gpu_hours", "GPU-hours the run's attempts held: each attempt's allocated seconds "
     "times the GPUs of its nodes (spares included; GPU jobs only)", True),
    ("train_gpu_hours", "lmlaunch_run_training_gpu_hours", "Of lmlaunch_run_gpu_hours, the hours in training steps "
     "(goodput in GPU-hours)", True),
)


def families(rows: Sequence[monitor.StatusRow], ledgers: Sequence[Sequence[Mapping[str, Any]]], *,
             slurm_reachable: bool, submitted: Sequence[Mapping[str, float]] | None = None,
             heartbeats: Sequence[Sequence[Mapping[str, Any]]] | None = None, now: float | None = None) -> list[Metric]:
    """Pure: status rows (and each run's ledger; ``submitted``: each run's job id -> submit time, from
    the registry; ``heartbeats``: each run's heartbeat tail) -> the metric families of one scrape."""
    now = time.time() if now is None else now
    info = GaugeMetricFamily("lmlaunch_run_info", "A run: its current job, the cluster profile that job went to, "
                             "SLURM state and state group (value 1)", labels=["run", "job_id", "cluster", "state", "group"])
    gauges = {attr: GaugeMetricFamily(name, text, labels=["run"]) for name, text, attr in ROW_GAUGES}
    requeued = GaugeMetricFamily("lmlaunch_run_requeued", "1 while the run's job was requeued by SLURM",
                                 labels=["run"])
    pending = GaugeMetricFamily("lmlaunch_run_pending_reason", "1 while the run's job waits in the queue, labelled "
                                "with SLURM's reason (Priority, Resources, BeginTime, JobHeldUser, ...)",
                                labels=["run", "reason"])
    ended = CounterMetricFamily("lmlaunch_run_attempts_ended", "Attempts that ended, by why (the ledger)",
                                labels=["run", "reason"])
    from_ledger = {key: (CounterMetricFamily if counter else GaugeMetricFamily)(name, text, labels=["run"])
                   for key, name, text, counter in LEDGER_SERIES}
    prepared = {key: GaugeMetricFamily(f"lmlaunch_run_prepared_{key}", f"{key.capitalize()} a `data prepare "
                                       "--on-cluster` run has tokenized so far (in the store once it ended; its shards "
                                       "are lmlaunch_run_step of _max_steps)", labels=["run"])
                for key in ("documents", "tokens")}
    for i, (row, ledger) in enumerate(zip(rows, ledgers)):
        info.add_metric([row.name, row.job_id or "", row.cluster, row.state, row.group], 1)
        for attr, family in gauges.items():
            value = getattr(row, attr)
            if value is not None:
                family.add_metric([row.name], float(value))
        requeued.add_metric([row.name], 1.0 if row.requeued else 0.0)
        if row.group == "queued" and row.reason:
            pending.add_metric([row.name, row.reason], 1.0)
        reasons = Counter(str(e.get("reason") or "unknown") for e in ledger if e.get("event") == "end")
        for reason, n in sorted(reasons.items()):
            ended.add_metric([row.name, reason], n)
        values = ledger_values(ledger, submitted=submitted[i] if submitted is not None else {},
                               running=row.group == "running", now=now)
        for key, value in values.items():
            if value is not None:
                from_ledger[key].add_metric([row.name], float(value))
        prep = preparation_progress(heartbeats[i]) if heartbeats is not None else None
        for key, family in prepared.items():
            if prep is not None:
                family.add_metric([row.name], float(prep[key]))
    up = GaugeMetricFamily("lmlaunch_slurm_up", "1 when the SLURM controller answered this scrape")
    up.add_metric([], 1.0 if slurm_reachable else 0.0)
    count = GaugeMetricFamily("lmlaunch_runs", "Runs in the registry, by state group", labels=["group"])
    for group, n in sorted(Counter(r.group for r in rows).items()):
        count.add_metric([group], n)
    return [info, *gauges.values(), requeued, pending, ended, *from_ledger.values(), *prepared.values(), up, count]


def preparation_progress(heartbeat: Sequence[Mapping[str, Any]]) -> dict[str, int] | None:
    """A preparation's newest figures (lmtrain.data.prepare.array_task's heartbeat lines, the ones
    ``status`` notes): documents and tokens; None for a training run."""
    line = monitor.preparation_line(heartbeat)
    if line is None:
        return None
    tokens = line.get("tokens")
    return {"documents": int(line["documents"]), "tokens": int(tokens) if isinstance(tokens, int) else 0}


def ledger_values(ledger: Sequence[Mapping[str, Any]], *, submitted: Mapping[str, float], running: bool,
                  now: float) -> dict[str, float | None]:
    """One run's :data:`LEDGER_SERIES` values (None: the ledger does not say)."""
    measured = history_rows.memory_lines(ledger)
    held, peak = measured[max(measured)] if measured else (None, None)
    held_plan, peak_plan = history_rows.planned_memory_line(ledger)
    train_s, alloc_s = goodput_seconds(ledger, running=running, now=now)
    return {"started": sum(1 for e in ledger if e.get("event") == "start"), "lost": steps_lost(ledger),
            "in_place": sum(1 for e in ledger if e.get("event") == "end" and e.get("restart") == "in_place"),
            "spares": float(len(spares)) if (spares := monitor.spares_of(ledger)) is not None else None,
            "waited": queue_wait_s(ledger, submitted), "held": held, "peak": peak, "held_plan": held_plan,
            "peak_plan": peak_plan, "trained": train_s, "allocated": alloc_s,
            "goodput": min(1.0, train_s / alloc_s) if alloc_s > 0 else None,
            **dict(zip(("gpu_hours", "train_gpu_hours"), gpu_hours(ledger, running=running, now=now)))}


def goodput_seconds(ledger: Sequence[Mapping[str, Any]], *, running: bool, now: float) -> tuple[float, float]:
    """(training, allocated) seconds over the attempts: each from its start line (allocated) or its
    first step (the ``startup`` line's process start plus its ``first_step`` phase: training) to its
    end line, or to ``now`` for the newest attempt while the run is running; an attempt that left no
    end line and is not running (killed outright) is left out, as ``history`` cannot time it either."""
    starts, ends, first = _ledger_times(ledger)
    train = alloc = 0.0
    for _, held, trained in _attempt_seconds(starts, ends, first, running=running, now=now):
        alloc, train = alloc + held, train + trained
    return train, alloc + restarting_seconds(ledger, starts, ends, running=running, now=now)


def _ledger_times(ledger: Sequence[Mapping[str, Any]]
                  ) -> tuple[list[Mapping[str, Any]], dict[int, float], dict[int, float]]:
    """The start lines; each attempt's end time and first step's time (a ``startup`` line's process
    start plus its ``first_step`` phase)."""
    starts = [e for e in ledger if e.get("event") == "start" and isinstance(e.get("attempt"), int)
              and isinstance(e.get("time"), (int, float))]
    ends = {e["attempt"]: float(e["time"]) for e in ledger if e.get("event") == "end"
            and isinstance(e.get("attempt"), int) and isinstance(e.get("time"), (int, float))}
    first: dict[int, float] = {}
    for e in ledger:
        phases = e.get("phases") if e.get("event") == "startup" else None
        if isinstance(phases, Mapping) and isinstance(e.get("attempt"), int) \
                and isinstance(e.get("process_start"), (int, float)) and isinstance(phases.get("first_step"), (int, float)):
            first[e["attempt"]] = float(e["process_start"]) + float(phases["first_step"])
    return starts, ends, first


def _attempt_seconds(starts: Sequence[Mapping[str, Any]], ends: Mapping[int, float], first: Mapping[int, float], *,
                     running: bool, now: float) -> list[tuple[Mapping[str, Any], float, float]]:
    """(start line, allocated seconds, training seconds) of each attempt that can be timed."""
    out = []
    for i, s in enumerate(starts):
        n = s["attempt"]
        end = ends.get(n, now if running and i == len(starts) - 1 else None)
        if end is None or end < float(s["time"]):
            continue
        out.append((s, end - float(s["time"]), end - first[n] if n in first and first[n] <= end else 0.0))
    return out


def gpu_hours(ledger: Sequence[Mapping[str, Any]], *, running: bool, now: float) -> tuple[float | None, float | None]:
    """(allocated, training) GPU-hours: each attempt's seconds as :func:`goodput_seconds` times the
    GPUs its start line says it held; (None, None) for a run whose attempts held no GPUs."""
    starts, ends, first = _ledger_times(ledger)
    if not any(isinstance(s.get("gpus"), int) and s["gpus"] > 0 for s in starts):
        return None, None
    held = trained = 0.0
    for s, alloc_s, train_s in _attempt_seconds(starts, ends, first, running=running, now=now):
        gpus = int(s["gpus"]) if isinstance(s.get("gpus"), int) else 0
        held, trained = held + gpus * alloc_s / 3600, trained + gpus * train_s / 3600
    return held, trained


def restarting_seconds(ledger: Sequence[Mapping[str, Any]], starts: Sequence[Mapping[str, Any]],
                       ends: Mapping[int, float], *, running: bool, now: float) -> float:
    """The allocation's seconds between attempts restarted in place: from an end line that says
    ``restart: in_place`` to the next start line (or to now while the ranks start again): the
    job holds its nodes throughout, training nothing."""
    in_place = [e["attempt"] for e in ledger if e.get("event") == "end" and e.get("restart") == "in_place"
                and isinstance(e.get("attempt"), int) and e["attempt"] in ends]
    total = 0.0
    for n in in_place:
        after = [float(s["time"]) for s in starts if s["attempt"] > n]
        until = min(after) if after else (now if running else None)
        if until is not None and until >= ends[n]:
            total += until - ends[n]
    return total


def queue_wait_s(ledger: Sequence[Mapping[str, Any]], submitted: Mapping[str, float]) -> float:
    """Seconds from each job's submission (its first attempt) or the attempt before's end line (a
    requeued attempt of the same job) to each attempt's start line."""
    total, last_end, seen_jobs = 0.0, None, set()
    for e in ledger:
        when = e.get("time")
        if not isinstance(when, (int, float)):
            continue
        if e.get("event") == "end":
            last_end = float(when)
        elif e.get("event") == "start":
            job = str(e.get("job_id"))
            since = submitted.get(job) if job not in seen_jobs else last_end
            if isinstance(since, (int, float)) and when >= since:
                total += float(when) - float(since)
            seen_jobs.add(job)
    return total


def steps_lost(ledger: Sequence[Mapping[str, Any]]) -> int:
    """Steps the run trained twice: for each attempt that ended, its end step less the start step
    of the attempt after it (an attempt without an end line, killed outright, is not counted)."""
    starts = [e for e in ledger if e.get("event") == "start" and isinstance(e.get("attempt"), int)]
    ends = {e["attempt"]: e.get("end_step") for e in ledger if e.get("event") == "end" and isinstance(e.get("attempt"), int)}
    total = 0
    for this, nxt in zip(starts, starts[1:]):
        end, again = ends.get(this["attempt"]), nxt.get("start_step")
        if isinstance(end, int) and isinstance(again, int):
            total += max(0, end - again)
    return total


def rank_families(rows: Sequence[monitor.StatusRow]) -> list[Metric]:
    """Per-rank series of the running runs, from rank 0's summary file (one small read a run):
    each rank's newest seconds per step by part, its compute against the others' median, whether
    it is slow."""
    seconds = GaugeMetricFamily("lmlaunch_rank_step_seconds",
                                "A rank's seconds per optimizer step in its newest logging interval, by part "
                                "(forward: the compute compared; backward and boundary include waits for peers)",
                                labels=["run", "rank", "node", "part"])
    ratio = GaugeMetricFamily("lmlaunch_rank_compute_ratio", "A rank's compute per step against the other ranks' "
                              "median, in the newest scored interval (1: as fast as they are)",
                              labels=["run", "rank", "node"])
    slow = GaugeMetricFamily("lmlaunch_rank_slow", "1 while the straggler watch finds the rank slow (against its "
                             "peers or its own history), else 0", labels=["run", "rank", "node"])
    count = GaugeMetricFamily("lmlaunch_run_slow_ranks", "How many of the run's ranks are slow now", labels=["run"])
    for row in rows:
        if row.group != "running":
            continue
        summary = run_files.read_rank_times(Path(row.run_dir))
        if summary is None or summary.get("attempt") != row.attempt:
            continue  # none, or an earlier attempt's ranks (until this one's first look)
        flagged = 0
        for rank, figures in sorted(summary["ranks"].items(), key=lambda kv: int(kv[0])):
            labels = [row.name, str(rank), str(figures.get("node"))]
            for part in straggler_lines.TIMING_PARTS:
                if isinstance(figures.get(part), (int, float)):
                    seconds.add_metric([*labels, part], float(figures[part]))
            if isinstance(figures.get("vs_peers"), (int, float)):
                ratio.add_metric(labels, float(figures["vs_peers"]))
            slow.add_metric(labels, 1.0 if figures.get("slow") else 0.0)
            flagged += bool(figures.get("slow"))
        count.add_metric([row.name], flagged)
    return [seconds, ratio, slow, count]


def eval_families(rows: Sequence[monitor.StatusRow]) -> list[Metric]:
    """The evaluator alongside a run (eval.alongside): its newest scored checkpoint's metrics, by task
    and metric, that checkpoint's step, how many are scored, and 1 while it is in trouble (failed,
    killed: training goes on)."""
    value = GaugeMetricFamily("lmlaunch_run_eval", "The newest scored checkpoint's value of an lm-eval metric "
                              "(eval.alongside)", labels=["run", "task", "metric"])
    step = GaugeMetricFamily("lmlaunch_run_eval_step", "Step of the newest checkpoint the evaluator scored",
                             labels=["run"])
    scored = GaugeMetricFamily("lmlaunch_run_eval_checkpoints_scored", "Checkpoints the evaluator has scored",
                               labels=["run"])
    trouble = GaugeMetricFamily("lmlaunch_run_evaluator_failed", "1 while the run's evaluator failed or was killed "
                                "this attempt (the training goes on), else 0", labels=["run"])
    for row in rows:
        ev = row.eval
        if not ev:
            continue
        latest = ev.get("latest") or {}
        for key, v in sorted((latest.get("scores") or {}).items()):
            task, _, metric = key.partition("/")
            if isinstance(v, (int, float)):
                value.add_metric([row.name, task, metric], float(v))
        if latest.get("step") is not None:
            step.add_metric([row.name], float(latest["step"]))
        scored.add_metric([row.name], float(ev.get("scored") or 0))
        trouble.add_metric([row.name], 1.0 if ev.get("trouble") else 0.0)
    return [value, step, scored, trouble]
