"""SIGKILL at every step of a checkpoint write never leaves a checkpoint that a restart loads but
is incomplete.

Each trial forks a process that saves step 2 over a directory holding a complete step 1 (and
keep_last=1, so the save also deletes step 1) with two ranks (two threads, each with its own
rank, meeting at real barriers, writing their own rank files), and SIGKILLs itself at the n-th
write/fsync/rename/marker step (a ``checkpoint.*`` rule of lmtrain.faults with nth=n): between the ranks' files, before and
after the rename, the COMPLETE marker, the ``latest`` pointer and the deletion of the old
checkpoint. After each kill the newest complete checkpoint must load entirely and hold exactly
what was saved for its step; then a next save (step 3) must succeed over the debris.

The same file written in the background (DDP's periodic saves, lmtrain.checkpoint.async_checkpoint): the
state copied into host memory, then rank 0's writer thread writes it and completes the
checkpoint; the kill points inside that thread end the process as well.

Three layouts of ``lightning.ckpt``: one file written by rank 0 (DDP); DeepSpeed's directory
(every rank writes its own ``zero_pp_rank_R_..._optim_states.pt`` in parallel through DeepSpeed's
checkpoint engine, rank 0 the model states and ``latest``); FSDP2's DCP directory
(``__R_0.distcp`` per rank, rank 0 ``.metadata``).

The sharded layouts written in the background too (lmtrain.checkpoint.async_sharded): every rank stages its
own part, then its own writer thread writes and fsyncs its files; the writer threads agree
through their own all-gather (a stand-in for the writers' gloo group: a barrier of their own)
and rank 0's completes the checkpoint. The kill points of every rank's writer thread are among
those counted and killed at.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
from pathlib import Path

# lightning's loader and torch's DTensor are imported once here, not again in each forked child
# (seconds each): what the saves import lazily
import lightning.fabric.utilities.load  # noqa: F401
import pytest
import torch
import torch.distributed.tensor
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
from waiting import HANG_S  # tests/waiting.py: a hang guard, not a verdict on speed

from lmcore.job.parallelism import Parallelism
from lmtrain import faults
from lmtrain.checkpoint import async_sharded, manager as ck
from lmtrain.checkpoint.shard_files import stream_deepspeed_files

WORLD = 2
SHARDED_BACKGROUND = ("zero-background", "dcp-background")


def _sharded(layout: str) -> str:
    """The shard layout of a layout name: "zero" and "dcp", written synchronously or in the background."""
    return layout.removesuffix("-background")


class _FileIO:
    """What the background save uses of the strategy's checkpoint IO (DirectCheckpointIO)."""

    def save_checkpoint(self, checkpoint, path) -> None:
        with open(path, "wb") as f:
            torch.save(checkpoint, f)


class _Strategy:
    """A strategy's collectives for ranks that are threads of one process (``shared`` is theirs)."""

    def __init__(self, barrier: threading.Barrier, rank: int, shared: dict) -> None:
        self._barrier, self.rank, self._shared = barrier, rank, shared
        self.checkpoint_io = _FileIO()
        self.deepspeed_engine = _Engine()  # used by the "zero" layouts only

    def barrier(self, name: str | None = None) -> None:
        self._barrier.wait(timeout=HANG_S)

    def broadcast(self, obj, src: int = 0):
        if self.rank == src:
            self._shared["broadcast"] = obj
        self.barrier()
        out = self._shared["broadcast"]
        self.barrier()
        return out

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        self._shared[f"vote-{self.rank}"] = bool(decision)
        self.barrier()
        votes = [self._shared[f"vote-{r}"] for r in range(WORLD)]
        self.barrier()
        return (min if all else max)(votes)

    def save_checkpoint(self, checkpoint, path) -> None:  # DDP: rank 0 writes Lightning's file
        if self.rank == 0:
            self.checkpoint_io.save_checkpoint(checkpoint, path)


class _Engine:
    """The DeepSpeed engine's part a save goes through: its checkpoint engine (DeepSpeed's own
    TorchCheckpointEngine, which torch.saves each file, made to stream them to disk as
    CheckpointManager.start does; the background save stands in for it while staging)."""

    def __init__(self) -> None:
        self.checkpoint_engine = TorchCheckpointEngine()
        assert stream_deepspeed_files(self)


class _Connector:
    """Trainer._checkpoint_connector: the state a background save copies into host memory (FSDP2:
    each rank's state holds its own shard)."""

    def __init__(self, step: int, rank: int, layout: str) -> None:
        self.step, self.rank, self.layout = step, rank, layout

    def dump_checkpoint(self, weights_only=None) -> dict:
        if self.layout == "dcp-background":
            return {"state_dict": _weights(self.step * 100 + self.rank), "optimizer_states": [],
                    "global_step": self.step}
        return {"state_dict": _weights(self.step), "global_step": self.step}


class _Writers:
    """lmtrain.checkpoint.async_sharded.WriterGroup for ranks that are threads: the writer threads' all-gather
    meets at a barrier of its own (the training threads' barrier is theirs)."""

    group = None

    def __init__(self, barrier: threading.Barrier, rank: int, shared: dict) -> None:
        self._barrier, self.rank, self.world, self._shared = barrier, rank, WORLD, shared

    def all_gather(self, obj) -> list:
        self._shared[f"gather-{self.rank}"] = obj
        self._barrier.wait(timeout=HANG_S)
        out = [self._shared[f"gather-{r}"] for r in range(WORLD)]
        self._barrier.wait(timeout=HANG_S)
        return out


def _fake_dcp_save(state: dict, path: Path, writers) -> None:
    """dcp.save as the writer threads call it: every rank its own ``__R_0.distcp``; once every rank
    wrote (DCP gathers the write results), the coordinator writes ``.metadata``."""
    with open(path / f"__{writers.rank}_0.distcp", "wb") as f:
        torch.save({"shard": state["state_dict"]}, f)
    writers.all_gather(None)
    if writers.rank == 0:
        with open(path / ".metadata", "wb") as f:
            torch.save({"ranks": writers.world}, f)


def _shard_files(layout: str) -> dict[int, list[str]]:
    """The files each rank writes inside lightning.ckpt (besides rank 0's model file)."""
    layout = _sharded(layout)
    if layout == "zero":
        return {r: [f"checkpoint/zero_pp_rank_{r}_mp_rank_00_optim_states.pt"] for r in range(WORLD)}
    if layout == "dcp":
        return {r: [f"__{r}_0.distcp"] for r in range(WORLD)}
    return {r: [] for r in range(WORLD)}


class _Trainer:
    """What CheckpointManager.save uses of a Trainer: rank, world size, barrier, save_checkpoint
    (layout "file": rank 0 writes Lightning's file, as under DDP; "zero"/"dcp": every rank writes
    its own shard into the directory, as DeepSpeed and FSDP2 do)."""

    def __init__(self, rank: int, barrier: threading.Barrier, step: int, layout: str, shared: dict) -> None:
        self.global_rank, self.world_size, self.step, self.layout = rank, WORLD, step, layout
        self.strategy = _Strategy(barrier, rank, shared)
        self._checkpoint_connector = _Connector(step, rank, layout)

    def save_checkpoint(self, path: str) -> None:
        if self.layout == "file":
            if self.global_rank == 0:
                torch.save({"state_dict": _weights(self.step), "global_step": self.step}, path)
            return
        root = Path(path)
        if _sharded(self.layout) == "zero":  # as DeepSpeed: every file through its checkpoint engine
            engine = self.strategy.deepspeed_engine.checkpoint_engine
            if self.global_rank == 0:
                engine.makedirs(str(root / "checkpoint"), exist_ok=True)
            self.strategy.barrier()
            if self.global_rank == 0:
                engine.save({"state_dict": _weights(self.step), "global_step": self.step},
                            str(root / "checkpoint/mp_rank_00_model_states.pt"))
            for rel in _shard_files(self.layout)[self.global_rank]:
                engine.save({"shard": _weights(self.step * 100 + self.global_rank)}, str(root / rel))
            if self.global_rank == 0:
                (root / "latest").write_text("checkpoint")  # DeepSpeed writes it itself
            self.strategy.barrier()
            return
        for rel in _shard_files(self.layout)[self.global_rank]:
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            torch.save({"shard": _weights(self.step * 100 + self.global_rank)}, root / rel)
        if self.global_rank == 0:
            with open(root / ".metadata", "wb") as f:  # torch.save refuses a path named ".metadata"
                torch.save({"state_dict": _weights(self.step), "global_step": self.step}, f)


def _weights(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g)}


def _save(ckpt_dir: Path, step: int, layout: str = "file") -> None:
    """Both ranks save ``step`` (threads, each with its own manager), as every rank does at a step boundary."""
    barrier, writer_barrier = threading.Barrier(WORLD), threading.Barrier(WORLD)
    shared: dict = {}
    errors: list[BaseException] = []
    background = layout == "background" or layout in SHARDED_BACKGROUND

    def rank_main(rank: int) -> None:
        strategy = {"zero": "deepspeed", "dcp": "fsdp"}.get(_sharded(layout), "ddp")  # DDP: rank 0 writes Lightning's file
        manager = ck.CheckpointManager(ckpt_dir, keep_last=1, every_n_steps=1, parallelism=Parallelism.of(strategy, WORLD),
                                       identity={"job_id": "1", "attempt": 1})
        if layout in SHARDED_BACKGROUND:  # what start_writers makes at train start: the writers' own group
            manager.writers = _Writers(writer_barrier, rank, shared)
        try:
            manager.save(_Trainer(rank, barrier, step, "file" if layout == "background" else layout, shared), step=step,
                         rank_state={"data_sampler": {"pos": step * 10 + rank}}, background=background)
            # the background layouts left the writing to this rank's writer thread (DDP: rank 0's only)
            assert manager.background.step == (step if layout in SHARDED_BACKGROUND or
                                               (background and rank == 0) else None), (layout, rank)
            manager.wait()  # every rank: its writer thread wrote its files (rank 0's completed the checkpoint)
        except BaseException as exc:  # surfaced by the caller
            errors.append(exc)
            barrier.abort()
            writer_barrier.abort()

    # ranks that are threads share no process group for real DCP: the synchronous FSDP2 save writes
    # the fake trainer's files, the background one goes through the fake dcp.save
    real_dcp_save, real_save_fsdp = async_sharded.dcp_save, ck.save_fsdp
    async_sharded.dcp_save = _fake_dcp_save
    ck.save_fsdp = lambda trainer, root: trainer.save_checkpoint(str(root))
    try:
        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(WORLD)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        async_sharded.dcp_save, ck.save_fsdp = real_dcp_save, real_save_fsdp
    if errors:
        raise errors[0]


def _in_child(fn, kill_at: int | None, report: Path | None = None) -> int:
    """Run ``fn`` in a forked child (optionally with the kill point armed); its wait status."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            if kill_at is not None:  # 0: count the points, kill at none
                action = {"point": "checkpoint.*", "action": "kill", "nth": kill_at} if kill_at else \
                    {"point": "checkpoint.*", "action": "count"}
                faults.load(json.dumps([action]))
            fn()
            if report is not None:
                report.write_text(str(faults.seen("checkpoint.*")))
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return status


def _assert_loads_completely(ckpt_dir: Path, layout: str = "file") -> int:
    newest = ck.newest_complete(ckpt_dir)
    assert newest is not None, f"no complete checkpoint in {sorted(p.name for p in ckpt_dir.iterdir())}"
    step = newest.step
    meta = newest.meta()
    assert meta["step"] == step and meta["world_size"] == WORLD
    model = {"file": "", "background": "", "zero": "checkpoint/mp_rank_00_model_states.pt", "dcp": ".metadata",
             "zero-background": "checkpoint/mp_rank_00_model_states.pt", "dcp-background": "meta.pt"}[layout]
    with open(newest.lightning_path / model if model else newest.lightning_path, "rb") as f:
        state = torch.load(f, map_location="cpu", weights_only=True)
    assert state["global_step"] == step
    if layout == "dcp-background":  # Lightning's meta.pt beside DCP's files: the state without the shards
        assert set(state) == {"global_step"}
        assert torch.load(newest.lightning_path / ".metadata", weights_only=True) == {"ranks": WORLD}
    else:
        assert all(torch.equal(state["state_dict"][k], v) for k, v in _weights(step).items())
    if _sharded(layout) == "zero":
        assert (newest.lightning_path / "latest").read_text() == "checkpoint"
    listed = json.loads((newest.path / ck.COMPLETE_NAME).read_text())["files"]
    for rank, rels in _shard_files(layout).items():
        for rel in rels:  # every rank's shard is there, holds this step's data, and is in the manifest
            shard = torch.load(newest.lightning_path / rel, map_location="cpu", weights_only=True)["shard"]
            assert all(torch.equal(shard[k], v) for k, v in _weights(step * 100 + rank).items())
            assert f"{ck.LIGHTNING_NAME}/{rel}" in listed
    for rank in range(WORLD):
        rs = newest.rank_state(rank)
        assert rs is not None, f"step-{step} is marked complete but has no rank-{rank}.pt"
        assert rs["data_sampler"] == {"pos": step * 10 + rank} and rs["step"] == step
    return step


@pytest.fixture(scope="module", params=["file", "background", "zero", "dcp", *SHARDED_BACKGROUND])
def step1_template(request, tmp_path_factory) -> tuple[Path, int, str]:
    """A checkpoint dir with a complete step 1, how many kill points saving step 2 passes, the layout."""
    layout = request.param
    root = tmp_path_factory.mktemp(f"kill-template-{layout}")
    template = root / "checkpoints"
    assert _in_child(lambda: _save(template, 1, layout), kill_at=None) == 0
    probe = root / "probe"
    shutil.copytree(template, probe)
    report = root / "points"
    assert _in_child(lambda: _save(probe, 2, layout), kill_at=0, report=report) == 0
    return template, int(report.read_text()), layout


def test_save_passes_at_least_20_kill_points(step1_template):
    _, points, layout = step1_template
    assert points >= 20 + (2 if layout != _sharded(layout) or layout in ("zero", "dcp") else 0), points  # + each rank's shard fsync


def test_sigkill_at_every_checkpoint_step_leaves_a_loadable_complete_checkpoint(step1_template, tmp_path):
    template, points, layout = step1_template
    resumed_from = []
    for n in range(1, points + 1):
        ckpt_dir = tmp_path / f"kill-{n}" / "checkpoints"
        shutil.copytree(template, ckpt_dir)
        status = _in_child(lambda d=ckpt_dir: _save(d, 2, layout), kill_at=n)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (n, status)
        step = _assert_loads_completely(ckpt_dir, layout)
        resumed_from.append(step)
        # the pointer may lag behind (killed before its update) but never names a newer step
        latest = (ckpt_dir / "latest").read_text().strip()
        assert int(latest.removeprefix("step-")) <= step
        # the restarted job saves again over whatever the kill left behind
        assert _in_child(lambda d=ckpt_dir: _save(d, 3, layout), kill_at=None) == 0
        assert _assert_loads_completely(ckpt_dir, layout) == 3
        assert sorted(p.name for p in ckpt_dir.iterdir()) == ["latest", "step-3"], n
        shutil.rmtree(ckpt_dir.parent)
    # early kills resume from step 1, late ones (after COMPLETE) from step 2
    assert resumed_from[0] == 1 and resumed_from[-1] == 2
    assert resumed_from == sorted(resumed_from)


def test_checkpoint_whose_files_do_not_match_its_manifest_is_not_complete(step1_template, tmp_path):
    template, _, layout = step1_template
    ckpt_dir = tmp_path / "checkpoints"
    shutil.copytree(template, ckpt_dir)
    assert _in_child(lambda: _save(ckpt_dir, 2, layout), kill_at=None) == 0
    # keep_last=1 removed step 1; bring a copy of step 2 back as a "step-5" missing a rank file,
    # with the COMPLETE (manifest) of step 2: the way an interrupted plain rmtree could leave it
    shutil.copytree(ckpt_dir / "step-2", ckpt_dir / "step-5")
    (ckpt_dir / "step-5" / "rank-1.pt").unlink()
    (ckpt_dir / "latest").write_text("step-5\n")
    assert json.loads((ckpt_dir / "step-2" / "COMPLETE").read_text())["files"]["rank-1.pt"] > 0
    assert ck.newest_complete(ckpt_dir).step == 2
    if _sharded(layout) in ("zero", "dcp"):  # a missing shard of a sharded checkpoint is caught the same way
        shutil.copytree(ckpt_dir / "step-2", ckpt_dir / "step-6")
        rel = _shard_files(layout)[1][0]
        (ckpt_dir / "step-6" / ck.LIGHTNING_NAME / rel).unlink()
        assert ck.newest_complete(ckpt_dir).step == 2
    # latest naming a deleted directory falls back the same way
    (ckpt_dir / "latest").write_text("step-9\n")
    assert ck.newest_complete(ckpt_dir).step == 2
