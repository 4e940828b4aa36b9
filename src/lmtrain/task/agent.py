"""Each SLURM task's agent: a restart in place that rank 0 decided is a fork, not a new srun.

A restart in place used to end the srun step and start a new one (the loop launcher.submit.script renders): every
rank a new interpreter that imports torch, Lightning and transformers again, most of the seconds
from a crash to the first step again. With ``preemption.warm_restart`` (and restart_in_place),
the task's process (lmtrain.task.main) becomes an agent instead: it imports the frameworks once and
forks the training process from itself. When the ranks' training processes end:

- rank 0's agent reads rank 0's decision (lmcore.run.rundir's RESTART_IN_PLACE, written by
  lmtrain.preemption.controller after the attempt's end line). A ``restart`` that leaves no node out,
  in a job SLURM is not preempting, it proposes to the others: ``restart`` in its verdict file
  (``rendezvous/<key>.next``). Every other agent ends its training process if it still runs (a
  rank stuck in a collective would hold the restart up to the collective timeout) and says it is
  ready: in its node's directory in ``/dev/shm``, whose leader (SLURM local rank 0), once its whole
  node is, writes one file for the node (``rendezvous/<key>.ready/node-<N>``; lmtrain.task.verdicts,
  lmtrain.distributed.node_share; ``ready/<rank>`` where a node's tasks share no ``/dev/shm``). The
  leader also reads the verdict for its node. With all of them ready, rank 0's agent removes the
  request and writes ``fork``; anything else (another decision, an agent that never answers
  because its node is gone) writes ``exit``;
- every agent acts on that word: ``fork`` forks a new training process in the same step (the
  next generation: its rendezvous key and :data:`GENERATION_VAR`); ``exit`` ends the agent as its
  training process ended (the same exit code or signal, which srun reports as before), so the
  step ends and the batch script's loop does what it did without agents: a restart that leaves a
  node out, one after rank 0 was killed before it decided, one after a node vanished, the
  preemption check, the requeue.

An agent whose training process died of a signal writes the rank's last words for it (srun never
sees that death), where rank 0 looks for the first death. The agent forwards the warning signal
and SIGTERM to its training process, and keeps them for the next one when they came while none
could act (lmtrain.preemption.signals.carry_over). Its training process dies with it (prctl
PR_SET_PDEATHSIG). The agent does not fork where its imports started CUDA (a forked child cannot
use it): the task then trains in the agent's own process, as without one.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmcore.processes import is_stopped
from lmcore.run.run_layout import BATCH_VAR, GENERATION_VAR, UNDECIDED_VAR, RunLayout
from lmtrain.distributed.node_share import NODE_SHARE_VAR, NodeShare, shares_dev_shm
from lmtrain.preemption.signals import SignalOwner, StopRequest
from lmtrain.task.verdicts import VERDICT_MARGIN_S, VERDICT_POLL_S, Verdicts

POLL_S = 1.0  # while a training process runs: its owner (podman's client) and rank 0's verdict
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class AgentSettings:
    run_dir: Path
    rank: int
    job_id: str  # SLURM_JOB_ID: the first line of rank 0's decision names it
    verdict_wait_s: float  # how long a rank's agent waits for rank 0's verdict once its process ended
    preload_deepspeed: bool  # on CPU only: deepspeed's import asks for CUDA on a GPU node
    simulate: bool = False  # the scale harness's ranks (lmtrain.simulate): no frameworks to import
    share: NodeShare | None = None  # what this node's agents look at once per node (lmtrain.distributed.node_share)
    stopped_s: float = 0.0  # a training process stopped (SIGSTOP) this long is killed by its agent (0: never)


def settings_of(plan: Mapping[str, Any], environ: Mapping[str, str]) -> AgentSettings | None:
    """Pure: the agent's settings from plan.json and the task's environment; None where the task
    runs without an agent (no SLURM task, no restart in place, warm_restart off, a plan before it)."""
    pre = plan.get("preemption") or {}
    if not (pre.get("restart_in_place") and pre.get("warm_restart")):
        return None
    if not environ.get("SLURM_PROCID", "").isdigit() or not environ.get("SLURM_JOB_ID"):
        return None
    watchdog = (plan.get("spec") or {}).get("watchdog") or {}
    longest = max(float(watchdog.get("collective_timeout_s") or 0), float(watchdog.get("hang_timeout_s") or 0))
    topology = plan.get("topology") or {}
    parallelism = topology.get("parallelism") or {}
    return AgentSettings(
        run_dir=Path((plan.get("paths") or {}).get("run_dir") or environ.get("LMLAUNCH_RUN_DIR", ".")),
        rank=int(environ["SLURM_PROCID"]), job_id=environ["SLURM_JOB_ID"],
        verdict_wait_s=longest + float(watchdog.get("exit_grace_s") or 0) + VERDICT_MARGIN_S,
        # a stopped process's own watchdog is stopped too: its agent, which is not, stands in for it
        stopped_s=float(watchdog.get("hang_timeout_s") or 0) and
        float(watchdog.get("hang_timeout_s") or 0) + float(watchdog.get("exit_grace_s") or 0),
        preload_deepspeed=topology.get("accelerator") == "cpu" and parallelism.get("zero_stage") is not None,
        simulate=bool((plan.get("spec") or {}).get("simulate")),
        share=NodeShare.of_task(environ, environ["SLURM_JOB_ID"], environ.get(BATCH_VAR, ""))
        if shares_dev_shm((plan.get("container") or {}).get("runtime")) else None,
    )


def settings_here(environ: Mapping[str, str] | None = None) -> AgentSettings | None:
    """This task's settings, from the run directory SLURM's environment names; None when it has none."""
    env = os.environ if environ is None else environ
    run_dir = env.get("LMLAUNCH_RUN_DIR")
    if not run_dir or env.get(GENERATION_VAR):  # a training process never becomes an agent itself
        return None
    try:
        plan = json.loads(RunLayout.of(run_dir).plan.read_text())
    except (OSError, ValueError):
        return None  # the task's own start says what is wrong with the run directory
    from lmtrain.simulate import fs_count

    fs_count.install_from_plan(plan, "agent", "agent", env)
    return settings_of(plan, env)


def read_decision(path: Path) -> list[str]:
    """Rank 0's decision file: [job id, nodes left out, decision], [] when there is none."""
    try:
        return path.read_text().splitlines()
    except OSError:
        return []


def takes_restart(said: list[str], job_id: str) -> bool:
    """Pure: whether rank 0's decision is a restart the agents fork themselves (this job's, a
    restart, no node left out); every other one is the batch script's."""
    field = (said + ["", "", ""])[:3]
    return field[0] == job_id and field[2] in ("", "restart") and not field[1].strip()


class TaskAgent:
    """One task's agent (the module's docstring): :meth:`serve` returns only in a training process."""

    def __init__(self, settings: AgentSettings, owner: SignalOwner) -> None:
        """``owner``: lmtrain.task.main's early signal owner, whose warning signal is the task's."""
        self.s = settings
        self.pid = os.getpid()
        self.layout = RunLayout.of(settings.run_dir)
        self.worker = 0
        self.generation = 0
        self.kept = owner  # what came while no training process could act on it
        self.phases: dict[str, float] = {}
        self.killed = False  # this agent ended its training process (rank 0 restarted without it)
        self.key, self.key_of = "", -1  # the rendezvous key of generation key_of (:meth:`_key`)
        self.verdicts = Verdicts(settings, self.layout, self._key)

    def serve(self) -> bool:
        """Import, then fork a training process and wait for it, again while rank 0 restarts in place.
        True in a training process (the caller trains) and where forking is unsafe (CUDA started)."""
        if not self._preload():
            return True
        from lmtrain.simulate import fs_count

        fs_count.phase("agent_wait")  # the scale harness's counters: what an agent does while its ranks train
        self.verdicts.begin()
        for signum in self.kept.signums:
            signal.signal(signum, self._on_signal)
        while True:
            if self._fork() == 0:
                return True
            status = self._wait()
            if self._verdict(status) != "fork":
                self._exit_like(status)
            self.generation += 1

    def _preload(self) -> bool:
        from lmtrain.observe.startup import imports_without_gc

        self.phases["entry"] = time.time()
        if self.s.simulate:  # the scale harness's ranks import no torch: nothing to preload, nothing started CUDA
            import submitit.core.submission

            self.phases["imports"] = time.time()
            return True
        with imports_without_gc(freeze=True):
            import submitit.core.submission  # noqa: F401

            import lmcore.job.plan  # noqa: F401
            from lmtrain.task.entry import import_frameworks

            import_frameworks(deepspeed=self.s.preload_deepspeed)
        self.phases["imports"] = time.time()
        import torch

        if torch.cuda.is_initialized() or _maps_libcuda():
            print("lmtrain: the frameworks' imports started CUDA in this task's agent; a forked training process "
                  "could not use it: training in this process (a restart in place is a new srun)",
                  file=sys.stderr, flush=True)
            return False
        return True

    def _on_signal(self, signum: int, frame: Any) -> None:
        if os.getpid() != self.pid:
            return  # a training process before it owns its signals (they are blocked then)
        self.kept._handle(signum, frame)  # kept for the next training process if this one cannot act
        if self.worker:
            try:
                os.kill(self.worker, signum)
            except ProcessLookupError:
                pass

    def _fork(self) -> int:
        signums = set(self.kept.signums)
        signal.pthread_sigmask(signal.SIG_BLOCK, signums)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        pid = os.fork()
        if pid == 0:
            self._become_worker()
            signal.pthread_sigmask(signal.SIG_UNBLOCK, signums)
            return 0
        self.worker = pid
        self.kept = SignalOwner(StopRequest(), self.kept.warning_name)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, signums)  # what came meanwhile is forwarded now
        return pid

    def _become_worker(self) -> None:
        """In the forked training process, signals still blocked: die with the agent, take this
        generation's environment, own the signals and what the agent kept for it."""
        _die_with_parent(self.pid)
        os.environ[GENERATION_VAR] = str(self.generation)
        if self.s.share is not None:
            os.environ[NODE_SHARE_VAR] = str(self.s.share.dir)
        if self.generation:
            os.environ[UNDECIDED_VAR] = ""  # rank 0 decided the restart: no end line is missing
        from lmtrain.observe.startup import CLOCK
        from lmtrain.preemption.signals import carry_over, own_signals

        CLOCK.forked(CLOCK.process_start if self.generation == 0 else time.time(),
                     self.phases if self.generation == 0 else None)
        own_signals({"signal": self.kept.warning_name})
        carry_over(self.kept)

    def _wait(self) -> int:
        """The training process's wait status. While it runs: the container's owner gone ends both;
        rank 0's verdict ``restart`` for this generation ends it (rank 0 recorded the attempt's end;
        a rank stuck in a collective would hold the restart up to the collective timeout)."""
        self.killed = False
        stopped_since: float | None = None
        while not _ended_within(self.worker, POLL_S):
            self.verdicts.look()
            if not owner_alive() or (self.s.rank != 0 and self.verdicts.read() in ("restart", "fork")):
                self.killed = True
                os.kill(self.worker, signal.SIGKILL)
            stopped_since = (stopped_since or time.monotonic()) if is_stopped(self.worker) else None
            if self.s.stopped_s and stopped_since is not None and time.monotonic() - stopped_since > self.s.stopped_s:
                self._kill_stopped(time.monotonic() - stopped_since)
                stopped_since = None
        _, status = os.waitpid(self.worker, 0)
        self.worker = 0
        if os.WIFSIGNALED(status) and not self.killed:
            self._last_words(os.WTERMSIG(status))
        return status

    def _kill_stopped(self, seconds: float) -> None:
        """The training process has been stopped (SIGSTOP: by hand, a debugger gone, a tool that froze
        it) past the hang watchdog's limit, which cannot fire in a stopped process: a hang no rank
        would ever report, holding the step (and the job) until its time limit. Killed, with last
        words saying why; the attempt then ends as a rank that died."""
        from lmcore.run.rundir import LastWords

        print(f"lmtrain: the training process {self.worker} has been stopped (SIGSTOP) for {seconds:.0f} s, past the "
              f"hang watchdog's {self.s.stopped_s:.0f} s: its agent kills it", file=sys.stderr, flush=True)
        self.killed = True
        try:
            attempt = int(json.loads(self.layout.rendezvous_file(self._key()).read_text())["attempt"])
            LastWords(rank=self.s.rank, node=os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
                      pid=self.worker, time=time.time(), how="signal",
                      detail=f"stopped (SIGSTOP) for {seconds:.0f} s: killed by its task's agent (hang)",
                      source="task's agent").write(self.s.run_dir, attempt)
        except (OSError, ValueError, KeyError):
            pass
        os.kill(self.worker, signal.SIGKILL)

    def _key(self) -> str:
        """This generation's rendezvous key (the one its training process used), computed once."""
        if self.key_of != self.generation:
            from lmtrain.distributed.task_env import read_env

            self.key = read_env({**os.environ, GENERATION_VAR: str(self.generation)}).rendezvous_key
            self.key_of = self.generation
        return self.key

    def _verdict(self, status: int) -> str:
        """``fork`` or ``exit``, the same for every agent of the step: rank 0's agent decides, the
        others follow its word (:meth:`_agree`)."""
        if self.s.rank != 0:
            return self.verdicts.follow()
        decided = self._decide()
        if decided == "restart":
            decided = self.verdicts.agree()
        self.verdicts.say(decided)
        if decided == "fork":
            self.layout.restart_request.unlink(missing_ok=True)  # taken here: the batch script must not restart too
            print(f"lmtrain: restarting the ranks in place in this srun step (generation {self.generation + 1})",
                  file=sys.stderr, flush=True)
        return decided

    def preempting(self) -> bool:
        """Whether SLURM is preempting this job (its PreemptTime set, GraceTime running)."""
        from lmtrain.preemption.slurm_facts import job_facts

        return (job_facts(self.s.job_id) or {}).get("PreemptTime", "")[:1].isdigit()

    def _decide(self) -> str:
        said = read_decision(self.layout.restart_request)
        if not takes_restart(said, self.s.job_id):
            return "exit"
        if self.preempting():
            print("lmtrain: the job is being preempted: the batch script requeues it, the ranks do not restart",
                  file=sys.stderr, flush=True)
            return "exit"
        return "restart"

    def _last_words(self, signum: int) -> None:
        """A training process that died of a signal: srun never sees it (this agent lives on); say it
        where rank 0 looks for the first death, for the attempt it was in."""
        from lmcore.run.rundir import LastWords

        try:
            attempt = int(json.loads(self.layout.rendezvous_file(self._key()).read_text())["attempt"])
            LastWords.say_for(self.s.run_dir, attempt, rank=self.s.rank, pid=None, code=-signum,
                              node=os.environ.get("SLURMD_NODENAME") or socket.gethostname(), source="task's agent")
        except (OSError, ValueError, KeyError):
            pass  # rank 0 then names the rank from what else it has

    def _exit_like(self, status: int) -> None:
        """End as the training process ended: srun reports the same exit code or signal. The warning
        signal is ignored from here on: the attempt is over, and Python gives a signal with a Python
        handler back its default action while the interpreter shuts down, so a time-limit warning
        then (SLURM sends it up to a minute early) killed this agent and SLURM recorded a run that
        had completed as FAILED (seen on 26.05 under load: both tasks "User defined signal 2" after
        the end line "completed"); lmtrain.preemption.signals.retire does the same in the training
        process."""
        signal.signal(self.kept.warning_signum, signal.SIG_IGN)
        self.verdicts.leave()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        if os.WIFSIGNALED(status):
            from lmtrain.simulate import fs_count

            fs_count.flush()  # the signal ends this process without its atexit
            signum = os.WTERMSIG(status)
            if signum not in (signal.SIGKILL, signal.SIGSTOP):  # those cannot be handled
                signal.signal(signum, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
            os.kill(os.getpid(), signum)
        raise SystemExit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


OWNER_ENV = "LMLAUNCH_TASK_PID"  # set by src/lmcore/job/podman_task.sh: the podman client SLURM started


def owner_alive(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the SLURM task that started this container is still there (always, outside podman:
    SLURM's own task is this process or its agent). The container shares the host's pids."""
    raw = (os.environ if environ is None else environ).get(OWNER_ENV, "")
    if not raw.isdigit():
        return True
    try:
        os.kill(int(raw), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's (cannot happen for our own client; be safe)
    return True


def _ended_within(pid: int, seconds: float) -> bool:
    """Whether child ``pid`` ended within ``seconds`` (not reaped): woken at its end by a pidfd,
    or, on a kernel without pidfds (before Linux 5.3), by polling."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
            time.sleep(VERDICT_POLL_S)
        return False
    try:
        return bool(select.select([fd], [], [], seconds)[0])
    finally:
        os.close(fd)


def _maps_libcuda() -> bool:
    try:
        return "libcuda.so" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def _die_with_parent(parent: int) -> None:
    """This process gets SIGKILL when its agent dies (Linux); already gone, it exits now."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os._exit(137)
