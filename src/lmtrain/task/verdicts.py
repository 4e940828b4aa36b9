"""Rank 0's verdict after the ranks of one start ended, and the other agents' readiness: the files
the task agents (lmtrain.task.agent) exchange for a restart in place, looked at once per node where
the node's agents share a directory (lmtrain.distributed.node_share)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

from lmcore.run.run_layout import RunLayout
from lmtrain.distributed.node_share import node_ready_name, ready_ranks

VERDICT_POLL_S = 0.05  # after it ended: how often a rank's agent looks for rank 0's verdict
VERDICT_MARGIN_S = 120.0  # beyond the longest rank 0 may take to decide (watchdog and collective timeouts)
LEAVE_WAIT_S = 5.0  # how long a node's leader waits for its node's agents to read the last word
READY_WAIT_S = 60.0  # how long rank 0's agent waits for the others to end their training processes
BEAT_S = 1.0  # rank 0's agent says it lives this often (its beat file), while it can decide
BEAT_LOOK_S = 5.0  # how often a rank's agent waiting for rank 0's word reads that beat
# Rank 0's agent's beat unchanged this long: it is gone (its whole task killed on its node: SLURM
# killing the step there, the OOM killer taking the task's cgroup). Read by content on each open (a
# shared filesystem's close-to-open consistency; no attribute cache, NFS's holds mtimes up to 60 s)
# and timed on each agent's own clock (the nodes' clocks may differ); well past the longest pause of
# a living agent (its one SLURM query, slurm_facts' 10 s). Mistaken, it costs a restart by a new srun.
SILENT_S = 45.0


class Verdicts:
    """One agent's side of the exchange (``settings``: its lmtrain.task.agent.AgentSettings; ``key``:
    the rendezvous key of the generation now)."""

    def __init__(self, settings: Any, layout: RunLayout, key: Callable[[], str]) -> None:
        self.s, self.layout, self.key = settings, layout, key
        self.seen: dict[str, float] = {}  # a node leader's look: the shared files' mtimes it copied
        self.beaten = 0.0  # rank 0's agent: when it last said it lives (monotonic)
        self.heard: tuple[str | None, float, float] = (None, 0.0, 0.0)  # another's: rank 0's beat, changed, looked

    def begin(self) -> None:
        """A node leader, before its first training process: the node's directory made, so that its
        node's agents read the copies there from the start (without it they read the shared file)."""
        share = self.s.share
        if share is not None and share.leader:
            share.remove_earlier()
            try:
                share.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            except OSError:
                pass  # the node's agents then read the shared files themselves

    def look(self) -> None:
        """Once a POLL_S while the agent's training process runs: rank 0's agent says it lives
        (:meth:`beat`); a node leader copies the profile request for its node (one stat of the shared
        file)."""
        self.beat()
        share = self.s.share
        if share is not None and share.leader:
            share.copy_if_changed(self.layout.profile_request, self.layout.profile_request.name, self.seen)

    def read(self) -> str | None:
        """Rank 0's word for this generation: a node leader reads the shared file and copies it for
        its node; the node's other agents read that copy (the shared file once the leader has
        removed the node's directory at its end)."""
        share, shared = self.s.share, self.layout.verdict_file(self.key())
        if share is not None and not share.leader and share.dir.is_dir():
            text = share.read(f"verdict-{self.key()}")
        elif share is not None and share.leader:
            text = share.copy(shared, f"verdict-{self.key()}")
        else:
            try:
                text = shared.read_text()
            except OSError:
                text = None
        return (text or "").strip() or None

    def beat(self, *, now: float | None = None) -> None:
        """Rank 0's agent, at most once a :data:`BEAT_S`: its beat file for this generation rewritten
        (a new content each time), which the others read while they wait for its word."""
        now = time.monotonic() if now is None else now
        if self.s.rank != 0 or now - self.beaten < BEAT_S:
            return
        self.beaten = now
        from lmcore.atomic import write_atomic

        path = self.layout.agent_beat_file(self.key())
        try:
            write_atomic(path, f"{time.time():.3f}\n")
        except FileNotFoundError:
            path.parent.mkdir(parents=True, exist_ok=True)  # the first beat of a run (no rendezvous yet)
        except OSError:
            pass  # a full or failing filesystem: the others wait SILENT_S, then end their tasks

    def rank0_silent(self, *, now: float | None = None) -> float | None:
        """Another rank's agent, waiting for rank 0's word: for how long rank 0's agent's beat has not
        changed, once that exceeds :data:`SILENT_S` (it is gone), else None. Read once a
        :data:`BEAT_LOOK_S`; the wait's start counts as a change (a beat never written)."""
        now = time.monotonic() if now is None else now
        text, changed, looked = self.heard
        if changed and now - looked < BEAT_LOOK_S:
            return None
        try:
            seen: str | None = self.layout.agent_beat_file(self.key()).read_text()
        except OSError:
            seen = None
        if not changed or seen != text:
            self.heard = (seen, now, now)
            return None
        self.heard = (text, changed, now)
        return now - changed if now - changed > SILENT_S else None

    def say(self, word: str) -> None:
        from lmcore.atomic import write_atomic

        self.beat()
        path = self.layout.verdict_file(self.key())
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, word + "\n")
        if self.s.share is not None:  # rank 0's own node reads it there
            try:
                self.s.share.put(f"verdict-{self.key()}", word + "\n")
            except OSError:
                pass  # its agents then wait for a word they never get: rank 0's exit ends the step

    def agree(self) -> str:
        """Rank 0's agent proposes the restart (``restart``: every agent ends its training process and
        says it is ready) and forks only when every agent said so within :data:`READY_WAIT_S`. An agent
        that never does is gone with its node (killed with its slurmd, powered off): then ``exit``, and
        the batch script's loop starts the ranks by a new srun once SLURM has taken the node out."""
        world = int(os.environ.get("SLURM_NTASKS") or 1)
        if world == 1:
            return "fork"
        self.say("restart")
        ready = self.layout.ready_dir(self.key())
        deadline = time.monotonic() + READY_WAIT_S
        share = self.s.share
        while True:
            self.beat()
            if share is not None:  # its own node's agents in the node's directory, the other nodes' leaders' counts
                count = share.ready_here(self.key()) + ready_ranks(ready)
            else:
                try:
                    count = len(os.listdir(ready))
                except OSError:
                    count = 0
            if count >= world - 1:
                return "fork"
            if time.monotonic() > deadline:
                print(f"lmtrain: {world - 1 - count} of the other ranks' agents did not answer within {READY_WAIT_S:.0f} s "
                      "(a node gone?): ending this srun step; the batch script starts the ranks again",
                      file=sys.stderr, flush=True)
                return "exit"
            time.sleep(VERDICT_POLL_S)

    def follow(self) -> str:
        """Another rank's agent: wait for rank 0's word; on ``restart`` say this agent is ready (its
        training process has ended) and wait for ``fork`` or ``exit``."""
        deadline = time.monotonic() + self.s.verdict_wait_s
        said, self.heard = False, (None, 0.0, 0.0)
        while (verdict := self.read()) not in ("fork", "exit"):
            if verdict == "restart" and not said and self.ready():
                said, deadline = True, time.monotonic() + READY_WAIT_S + VERDICT_MARGIN_S
            if time.monotonic() > deadline:
                print("lmtrain: rank 0's agent gave no word in time after this rank's training process ended: "
                      "ending this task", file=sys.stderr, flush=True)
                return "exit"
            if (silent := self.rank0_silent()) is not None:
                print(f"lmtrain: rank 0's agent has said nothing for {silent:.0f} s (its task killed on its node?): "
                      "ending this task; the batch script starts the ranks again", file=sys.stderr, flush=True)
                return "exit"
            time.sleep(VERDICT_POLL_S)
        return verdict

    def ready(self) -> bool:
        """Say this agent is ready for the restart rank 0 proposed (its training process ended):
        in the node's directory; a node's leader, once every agent of its node said so, for the
        whole node in the run directory (one file per node). False: not said yet (a leader waiting
        for its node)."""
        key, share = self.key(), self.s.share
        ready = self.layout.ready_dir(key)
        if share is None:
            ready.mkdir(parents=True, exist_ok=True)
            (ready / str(self.s.rank)).touch()
            return True
        if not share.leader:
            share.say_ready(key)
            return True
        if share.ready_here(key) < share.node_tasks - 1:
            return False
        from lmcore.atomic import write_atomic

        ready.mkdir(parents=True, exist_ok=True)
        write_atomic(ready / node_ready_name(share.node_rank), f"{share.node_tasks}\n")
        return True

    def leave(self) -> None:
        """This agent's step is over: a node's other agents say so in the node's directory; its leader
        waits for them (at most LEAVE_WAIT_S: one that has not read the word by then reads rank 0's
        file itself) and removes the directory."""
        share = self.s.share
        if share is None:
            return
        if not share.leader:
            try:
                (share.dir / f"done-{share.local_rank}").touch()
            except OSError:
                pass
            return
        deadline = time.monotonic() + LEAVE_WAIT_S
        while time.monotonic() < deadline:
            try:
                done = sum(1 for name in os.listdir(share.dir) if name.startswith("done-"))
            except OSError:
                break
            if done >= share.node_tasks - 1:
                break
            time.sleep(VERDICT_POLL_S)
        share.remove()

