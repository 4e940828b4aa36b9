"""The verdict of a chaos campaign (chaos_campaign.py): what each fault cost and how the run
recovered, and whether the run came through whole.

A campaign passes when the run ended COMPLETED at its last step; its per-step losses and final
weights equal the uninterrupted run's, bit for bit; every fault that ends an attempt shows in the
ledger and in `lmlaunch history` with the way it was recovered; no attempt resumed from a step
older than the newest checkpoint that was complete when the fault landed (and not corrupted before it was read);
and nothing is left behind: no job of the run queued, no node DOWN or drained, no process of the
job, no temporary file in the run directory, exactly ``keep_last`` checkpoints; with the checkpoints
in a bucket (a schedule that stops the gateway), the bucket holding the final one and no open upload.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import waiting
from chaos_campaign import Campaign, Landing, stopped_by_full_disk
from chaos_faults import FILLER
from chaos_schedule import SILENT_KINDS
from preempt_helpers import beats, ends, final_weights, lm, losses_by_step, starts, weights_digest

from lmcore.run.checkpoint_index import complete_checkpoints
from lmcore.slurm import client as slurm

TEMPORARY = re.compile(r"^\..*\.tmp(-\d+)?$|^\.step-\d+\.tmp$")


@dataclass
class Row:
    """One fault: where it landed and what it cost."""

    index: int
    kind: str
    landed: bool
    what: str
    step: int
    attempt: int | None = None  # the attempt it ended (None: none ended for it)
    reason: str = ""  # that attempt's end reason
    recovered: str = ""  # restart in place / spare / requeue / not needed
    resumed_from: int | None = None
    steps_lost: int | None = None
    recovery_s: float | None = None  # the fault -> the next attempt's start line
    problem: str = ""


@dataclass
class Verdict:
    seed: int
    ok: bool
    final_state: str
    rows: list[Row]
    problems: list[str] = field(default_factory=list)
    goodput: float | None = None
    wall_s: float = 0.0
    attempts: int = 0

    def table(self) -> str:
        head = f"{'#':>3} {'kind':<19} {'step':>5} {'attempt':>7} {'ended as':<13} {'recovered by':<34} " \
               f"{'from':>5} {'lost':>5} {'s':>6}"
        lines = [head]
        for r in self.rows:
            lines.append(
                f"{r.index:>3} {r.kind:<19} {r.step:>5} {_s(r.attempt):>7} {r.reason or '-':<13} "
                f"{(r.recovered if r.landed else 'did not land'):<34} {_s(r.resumed_from):>5} {_s(r.steps_lost):>5} "
                f"{_s(None if r.recovery_s is None else round(r.recovery_s, 1)):>6}" + (f"  !! {r.problem}" if r.problem else ""))
        lines.append(f"seed {self.seed}: {'PASSED' if self.ok else 'FAILED'}; job {self.final_state}, "
                     f"{self.attempts} attempts, goodput {self.goodput if self.goodput is None else round(self.goodput, 3)}, "
                     f"{self.wall_s:.0f} s")
        lines += [f"  problem: {p}" for p in self.problems]
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def _s(x: object) -> str:
    return "-" if x is None else str(x)


def _row(landing: Landing, c: Campaign, corruptions: list[tuple[float, int]]) -> Row:
    f, done = landing.fault, landing.done
    row = Row(f.index, f.kind, done.landed, done.what, landing.step)
    if not done.landed:
        return row
    if f.kind == "corrupt_checkpoint":
        return _corrupted(row, landing, c)
    if f.kind == "disk_full":
        return _filled(row, landing, c)
    if f.kind in SILENT_KINDS:
        row.recovered = "not needed"
        return row
    ended = [e for e in ends(c.run_dir) if e["time"] >= landing.at - 0.5]
    end = ended[0] if ended else None
    if f.kind == "time_limit" and end is not None and end["reason"] == "completed":
        row.recovered = "run done before the warning"  # SLURM looks at time limits every ~30 s
        return row
    if end is None or end["reason"] == "completed":
        row.problem = "no attempt ended for it" if end is None else "the attempt it hit completed"
        row.recovered = "none seen"
        return row
    row.attempt, row.reason = end["attempt"], end["reason"]
    following = [s for s in starts(c.run_dir) if s["attempt"] == end["attempt"] + 1]
    if stopped_by_full_disk(end):
        row.recovered = "submit --resume, room freed"
    elif end.get("restart") == "in_place":
        row.recovered = "restart in place" + (f", spare for {','.join(end['left_out'])}" if end.get("left_out") else "")
    else:
        row.recovered = "requeue" if end.get("requeued") or following else "none"
    row.problem = _path_problem(landing, end, c) or _keeperless_problem(landing, end, c)
    if not following:
        row.problem = f"attempt {end['attempt']} ended {end['reason']} and no attempt followed"
        return row
    nxt = following[0]
    row.resumed_from, row.recovery_s = nxt["start_step"], nxt["time"] - landing.at
    row.steps_lost = max(0, end["end_step"] - nxt["start_step"])
    # complete when the fault landed and not corrupted before the next attempt read it (a corruption
    # landing during the restart rightly sends it to an older one)
    corrupted = {step for at, step in corruptions if at < nxt["time"]}
    usable = [s for s in landing.complete if s not in corrupted]
    if usable and nxt["start_step"] < usable[-1]:
        row.problem = "; ".join(filter(None, [row.problem, f"resumed from step {nxt['start_step']}, older than step "
                                                             f"{usable[-1]}, complete when the fault landed"]))
    return row


def _path_problem(landing: Landing, end: dict, c: Campaign) -> str:
    """For a fault that met its attempt alone (no other fault landed in that attempt before it, nor
    from it to the attempt's end),
    the recovery its kind must take: a rank SIGKILLed is named (rank, SIGKILL) and the ranks restart
    in place in the same job; a rank SIGSTOPped ends the attempt as a hang (its peers' watchdogs) or
    a crash (its agent killed it), restarted in place; a batch script killed on a node that stays up
    is no node failure; a node failed while the attempt had a spare is left out for the spare, in place. What differed ("" when nothing did, or the fault was not alone)."""
    f, facts = landing.fault, landing.done.facts
    others = [la for la in c.landings if la is not landing and la.done.landed
              and (landing.at <= la.at <= end["time"] or (la.attempt == landing.attempt and la.at <= landing.at))]
    if others or landing.attempt != end["attempt"]:  # not alone: e.g. a lowered time limit refuses the restart in place
        return ""
    restart, death = end.get("restart"), end.get("first_death") or {}
    if f.kind == "rank_kill":
        named = ("rank 0's process ended before it decided" in end["detail"] if facts["rank"] == 0 else
                 (death.get("rank"), death.get("how")) == (facts["rank"], "killed by SIGKILL"))
        if end["reason"] != "crashed" or restart != "in_place" or not named:
            return (f"rank {facts['rank']} SIGKILLed alone: attempt {end['attempt']} ended {end['reason']} "
                    f"(restart {restart}, first death {death}): not a crash named so and restarted in place")
    if f.kind == "task_kill" and (end["reason"] != "crashed" or restart != "in_place"):
        return (f"rank {facts['rank']}'s whole task SIGKILLed alone: attempt {end['attempt']} ended {end['reason']} "
                f"(restart {restart}): not a crash restarted in place")
    if f.kind == "rank_stop" and (end["reason"] not in ("hang", "crashed") or restart != "in_place"):
        return (f"rank {facts['rank']} SIGSTOPped alone: attempt {end['attempt']} ended {end['reason']} (restart "
                f"{restart}): not a hang (or its rank killed by its agent) restarted in place")
    if f.kind == "batch_kill" and end["reason"] == "node_failure":
        return f"the batch script killed alone, its node up: attempt {end['attempt']} recorded as a node failure"
    if f.kind == "node_down":
        began = [s for s in starts(c.run_dir) if s["attempt"] == end["attempt"]]
        if began and began[0].get("spares") and (end["reason"], restart, end.get("left_out")) != (
                "node_failure", "in_place", [facts["node"]]):
            return (f"{facts['node']} failed alone with spare {began[0]['spares']} held: attempt {end['attempt']} "
                    f"ended {end['reason']}, restart {restart}, left out {end.get('left_out')}: not the spare in place")
    return ""


def _keeperless_problem(landing: Landing, end: dict, c: Campaign) -> str:
    """The batch script's node failed in an attempt whose keeper was killed before: only the run's
    watcher on the login side could requeue it (launcher.submit.batch_host_watch), and the end line
    must say it did."""
    killed = [la for la in c.landings if la.fault.kind == "keeper_kill" and la.done.landed
              and la.attempt == landing.attempt and la.at < landing.at]
    if landing.fault.kind != "batch_host_down" or not killed or end["attempt"] != landing.attempt:
        return ""
    if not end.get("watcher") or not end.get("requeued"):
        return (f"the batch script's node failed after the keeper was killed: attempt {end['attempt']} ended "
                f"{end['reason']}, requeued {end.get('requeued')}, not by the run's watcher ({end.get('detail')})")
    return ""


def _corrupted(row: Row, landing: Landing, c: Campaign) -> Row:
    """A corrupted checkpoint is never resumed from: a later attempt starting at its step must follow
    a new checkpoint of that step, written after the corruption."""
    step = landing.done.facts["checkpoint_step"]
    rewritten = [b["time"] for b in beats(c.run_dir) if b.get("event") == "checkpoint" and b.get("step") == step
                 and b["time"] > landing.at]
    later = [s for s in starts(c.run_dir) if s["time"] > landing.at]
    wrong = [s for s in later if s["start_step"] == step and not any(t < s["time"] for t in rewritten)]
    if wrong:
        row.problem = f"attempt {wrong[0]['attempt']} resumed from the corrupted checkpoint of step {step}"
    skipped = [s for s in later if s["start_step"] < step and not any(t < s["time"] for t in rewritten)]
    row.attempt = skipped[0]["attempt"] if skipped else None
    row.resumed_from = skipped[0]["start_step"] if skipped else None
    row.recovered = "skipped at resume" if skipped else ("rewritten" if rewritten else "never read")
    return row


def _filled(row: Row, landing: Landing, c: Campaign) -> Row:
    """A full disk costs the periodic saves it meets (skipped, training goes on) or, met by a
    stop-time or final save, the attempt (``disk_full``, resumed by hand: the fault that stopped it
    has that row); never a checkpoint half written."""
    until = landing.at + landing.fault.hold_s + 5.0
    skipped = [b for b in beats(c.run_dir) if b.get("event") == "checkpoint_failed" and landing.at <= b["time"] <= until]
    stopped = [e for e in ends(c.run_dir) if stopped_by_full_disk(e) and landing.at <= e["time"] <= until]
    row.recovered = (f"{len(skipped)} save(s) skipped" if skipped else "no save met it") + \
        (f"; attempt {stopped[0]['attempt']} ended {stopped[0]['reason']}" if stopped else "")
    return row


def _losses(c: Campaign, reference: dict) -> list[str]:
    got = losses_by_step(c.run_dir)
    diverged = sorted(s for s, vs in got.items() if any(v != reference["losses"].get(s) for v in vs))
    if diverged:
        s = diverged[0]
        return [f"first divergence at step {s}: losses {got[s]} against the uninterrupted {reference['losses'].get(s)}"]
    return []


def _weights(c: Campaign, reference: dict) -> list[str]:
    try:
        got = final_weights(c.run_dir, c.ckpt_dir)
    except AssertionError as exc:
        return [str(exc)]
    if got["step"] != reference["step"] or weights_digest(got) != reference["digest"]:
        return [f"final weights (step {got['step']}) differ from the uninterrupted run's (step {reference['step']})"]
    return []


def _history(c: Campaign, env: dict[str, str]) -> tuple[list[str], float | None]:
    code, out, err = lm(env, "history", c.name, "--json")
    if code != 0:
        return [f"lmlaunch history exited {code}: {err[-300:]}"], None
    told = json.loads(out)
    seen = [(a["attempt"], a["reason"]) for a in told["attempts"]]
    ledger = [(e["attempt"], e["reason"]) for e in ends(c.run_dir)]
    problems = [] if seen == ledger else [f"history tells attempts {seen}, the ledger {ledger}"]
    code, out, _ = lm(env, "history", c.name)
    if code != 0 or not all(reason in out for _, reason in ledger):
        problems.append(f"`lmlaunch history {c.name}` does not name every attempt's end:\n{out[-1500:]}")
    return problems, told.get("goodput")


def leftovers(c: Campaign, keep_last: int) -> list[str]:
    """What the run left behind on the cluster and in its run directory."""
    out = []
    queued = [j for j in slurm.squeue() if j.job_id in c.jobs]
    out += [f"job {j.job_id} still queued ({j.state})" for j in queued]
    waiting.until(lambda: not any("comp" in n.state.lower() for n in slurm.nodes()),
                  progress=lambda: tuple((n.name, n.state) for n in slurm.nodes()), what="nodes done completing")
    out += [f"node {n.name} is {n.state} ({n.reason})" for n in slurm.nodes()
            if any(w in n.state.lower() for w in ("down", "drain", "fail"))]
    for job in c.jobs:
        out += [f"process {pid} of job {job} still runs: {cmd}" for pid, cmd in _job_processes(job, c.run_dir)]
    for root in {c.run_dir, c.ckpt_dir}:
        out += [f"temporary file left: {path}" for path in root.rglob("*") if TEMPORARY.match(path.name)]
    if c.small_fs is not None and (c.small_fs / FILLER).exists():
        out.append(f"the full disk's {FILLER} left on {c.small_fs}")
    ckpts = c.ckpt_dir
    complete = [ck.step for ck in complete_checkpoints(ckpts)]
    steps = sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step-")) if ckpts.is_dir() else []
    if len(complete) != keep_last or len(steps) != keep_last:
        out.append(f"checkpoints: {steps} on disk, complete {complete}; keep_last is {keep_last}")
    return out


def bucket_problems(c: Campaign, keep_last: int) -> list[str]:
    """A run whose checkpoints are in a bucket (a schedule that stopped the gateway): at its end the
    bucket holds its final checkpoint, at most ``keep_last`` complete ones, and no upload left open
    (the uploads the gateway's absence cost were made good once it was back)."""
    if c.bucket is None:
        return []
    out = []
    if not c.bucket_complete or c.bucket_complete[-1] != f"step-{c.schedule.max_steps}" \
            or len(c.bucket_complete) > keep_last:
        out.append(f"the bucket holds {c.bucket_complete} complete at the end: not the final step-"
                   f"{c.schedule.max_steps} among at most keep_last {keep_last}")
    if c.bucket_open:
        out.append(f"{c.bucket_open} multipart upload(s) left open in {c.bucket}")
    return out


def _job_processes(job: str, run_dir: Path) -> list[tuple[int, str]]:
    """The processes of the run's job ``job`` on this campaign's cluster: those naming its run directory,
    and those of a job of that id whose slurmd is this cluster's (SLURM_CONF: job ids are per cluster,
    and the worker clusters of other tests run jobs of the same small ids beside it)."""
    found = []
    needle, path = f"SLURM_JOB_ID={job}\0".encode(), str(run_dir).encode()
    conf = os.environ.get("SLURM_CONF")  # the worker cluster's: the caller is inside its own_conf
    cluster = f"SLURM_CONF={conf}\0".encode() if conf else b""
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if (needle in environ and cluster in environ) or path in cmd:
            found.append((int(entry), cmd.replace(b"\0", b" ").decode(errors="replace")[:200]))
    return found


def judge(c: Campaign, reference: dict, env: dict[str, str], *, keep_last: int) -> Verdict:
    """The verdict of campaign ``c`` against the uninterrupted ``reference`` (chaos_campaign.reference);
    the caller is inside the worker cluster's own_conf."""
    corruptions = [(la.at, la.done.facts["checkpoint_step"]) for la in c.landings
                   if la.done.landed and la.fault.kind == "corrupt_checkpoint"]
    rows = [_row(landing, c, corruptions) for landing in c.landings]
    problems = [f"fault #{r.index} {r.kind}: {r.problem}" for r in rows if r.problem]
    last = ends(c.run_dir)[-1:] or [{}]
    if c.final_state != "COMPLETED" or last[0].get("reason") != "completed" or \
            last[0].get("end_step") != c.schedule.max_steps:
        problems.append(f"the job ended {c.final_state}, its last attempt {last[0]}")
    problems += _losses(c, reference) + _weights(c, reference)
    told, goodput = _history(c, env)
    problems += told + [f"left behind: {x}" for x in leftovers(c, keep_last)] + bucket_problems(c, keep_last)
    undone = [la for la in c.landings if la.done.undo is not None and la.done.landed]
    problems += [f"fault #{la.fault.index} not undone: {la.undone}" for la in undone if la.undone.startswith("undo failed")]
    return Verdict(c.schedule.seed, not problems, c.final_state, rows, problems, goodput, c.ended - c.began,
                   len(starts(c.run_dir)))
