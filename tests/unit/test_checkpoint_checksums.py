"""Every checkpoint that loads is the one that was written: COMPLETE's manifest holds a checksum of
every file (computed while it is written), a resume checks them on every rank before loading and
falls back to the previous checkpoint when a file was damaged at the same size, and `lmlaunch
export` never exports a damaged one. (Before: bytes zeroed inside an FSDP shard or a ZeRO-3
master-weight shard exported with exit 0, and --resume trained on the damaged weights.)"""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path

import pytest

from launcher.cli import main
from launcher.context import Context
from launcher.submit.local_run import prepare_local_run
from lmcore.digests import file_digest
from lmcore.run.checkpoint_index import (
    CHECKSUM_ALGORITHM,
    CORRUPT_NAME,
    complete_checkpoints,
    incomplete_reason,
    manifest_checksums,
    mark_corrupt,
    shares,
    verify,
)
from lmtrain.local.launch import launch

HELPER = Path(__file__).with_name("_train_with_stop.py")
OVERRIDES = [
    "model.config.n_layer=1", "model.config.n_embd=32", "model.config.n_head=2", "model.config.n_positions=32",
    "data.seq_len=32", "data.micro_batch_size=4", "trainer.global_batch_size=8", "trainer.log_every_n_steps=1",
    "trainer.val_check_interval=null", "checkpoint.every_n_steps=3", "checkpoint.keep_last=2",
    "optim.warmup_steps=2",
]
MAX_STEPS = 9
# the file that holds weights, in rank 1's share where the strategy shards them: DDP's one
# Lightning file (rank 0 writes it), FSDP2's DCP shard, ZeRO's fp32 master partition of rank 1
ZERO_PARTITION = "lightning.ckpt/checkpoint/zero_pp_rank_1_mp_rank_00_optim_states.pt"
DAMAGED = {
    "ddp": (["trainer.strategy=ddp"], "lightning.ckpt"),
    "fsdp": (["trainer.strategy=fsdp"], "lightning.ckpt/__1_0.distcp"),
    "zero1": (["trainer.strategy=deepspeed", "trainer.zero_stage=1"], ZERO_PARTITION),
    "zero2": (["trainer.strategy=deepspeed", "trainer.zero_stage=2"], ZERO_PARTITION),
    "zero3": (["trainer.strategy=deepspeed", "trainer.zero_stage=3"], ZERO_PARTITION),
}


def _write_step_dir(root: Path, files: dict[str, bytes], with_sums: bool = True) -> Path:
    root.mkdir(parents=True)
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    complete = {"step": 1, "files": {rel: len(data) for rel, data in files.items()}}
    if with_sums:
        complete["checksums"] = {"algorithm": CHECKSUM_ALGORITHM, "files": {r: file_digest(root / r) for r in files}}
    (root / "COMPLETE").write_text(json.dumps(complete))
    return root


def _damage(path: Path) -> None:
    """Same size, other bytes: 64 bytes in the middle of the file inverted."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 64] = bytes(b ^ 0xFF for b in data[mid:mid + 64])
    path.write_bytes(bytes(data))


def test_a_damaged_file_of_the_same_size_is_named_and_the_mark_makes_the_checkpoint_incomplete(tmp_path):
    files = {"rank-0.pt": b"a" * 1000, "rank-1.pt": b"b" * 10, "lightning.ckpt/__0_0.distcp": b"c" * 3000,
             "lightning.ckpt/.metadata": b"d" * 5}
    step = _write_step_dir(tmp_path / "step-1", files)
    assert verify(step) == [] and incomplete_reason(step) is None
    # the ranks' shares: every file once, split by bytes, the same on every rank
    split = shares(step, 2)
    assert sorted(f for s in split for f in s) == sorted(files) and split == shares(step, 2)
    assert split[0] == ["lightning.ckpt/__0_0.distcp"]  # the largest alone; the rest to the other reader
    assert shares(step, 1) == [sorted(files, key=lambda r: (-len(files[r]), r))]

    _damage(step / "rank-0.pt")
    (problem,) = verify(step)
    assert problem.startswith(f"rank-0.pt: {CHECKSUM_ALGORITHM} ") and "differs from the" in problem
    assert verify(step, split[0]) == [] and verify(step, split[1]) == [problem]
    assert incomplete_reason(step) is None  # listing a run stays cheap: sizes only
    mark_corrupt(step, [problem])
    assert incomplete_reason(step) == f"its files failed their checksums: {problem}"
    assert complete_checkpoints(tmp_path) == []

    # a checkpoint written before checksums is trusted as it was
    old = _write_step_dir(tmp_path / "old" / "step-1", {"rank-0.pt": b"x" * 8}, with_sums=False)
    _damage(old / "rank-0.pt")
    assert verify(old) == [] and manifest_checksums(old) is None and incomplete_reason(old) is None


def _plan(repo: Path, name: str, strategy: str):
    overrides = [*OVERRIDES, *DAMAGED[strategy][0]]
    return prepare_local_run(
        str(repo / "jobs" / "tiny-cpu.yaml"), overrides, devices=2, max_steps=MAX_STEPS, name=name,
        environ=dict(os.environ), say=lambda *_: None,
        resume=(Path(os.environ["LMLAUNCH_RUNS_ROOT"]) / name).is_dir(),
    )


def _launch(plan, stop_at: int) -> int:
    run_dir = plan.paths.run_dir
    return launch(run_dir, plan.topology.world_size, plan_env=plan.env, threads_per_proc=1,
                  command=[sys.executable, "-u", str(HELPER), run_dir, str(stop_at)],
                  out=open(Path(run_dir) / "launcher.out", "a"))


def _losses(run_dir: str, attempt: int) -> dict[int, float]:
    beats = [json.loads(x) for x in Path(run_dir, "metrics", "heartbeat.jsonl").read_text().splitlines()]
    return {b["step"]: b["loss"] for b in beats if b["event"] == "step" and b["attempt"] == attempt}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", sorted(DAMAGED))
def test_a_resume_falls_back_from_a_damaged_shard_and_export_skips_it(repo, runs_root, strategy):
    plan = _plan(repo, f"damaged-{strategy}", strategy)
    run_dir, ckpt_dir = plan.paths.run_dir, Path(plan.paths.checkpoint_dir)
    assert _launch(plan, stop_at=6) == 0  # periodic step-3, the stop's step-6
    newest = complete_checkpoints(ckpt_dir)[-1]
    assert newest.step == 6
    sums = manifest_checksums(newest.path)
    assert sums is not None and set(sums) == set(json.loads((newest.path / "COMPLETE").read_text())["files"])
    assert not list(newest.path.rglob(".sums-rank-*"))  # the ranks' reports were merged into COMPLETE
    assert verify(newest.path) == []  # what was streamed is what is on disk
    damaged = DAMAGED[strategy][1]
    _damage(newest.path / damaged)

    assert _launch(_plan(repo, f"damaged-{strategy}", strategy), stop_at=0) == 0
    ledger = [json.loads(x) for x in Path(run_dir, "attempts.jsonl").read_text().splitlines()]
    (note,) = [e for e in ledger if e["event"] == "checkpoint_rejected"]
    assert note["attempt"] == 2 and note["step"] == 6 and note["fallback"] == "step-3", note
    assert [p.split(":")[0] for p in note["problems"]] == [damaged], note
    starts = [e for e in ledger if e["event"] == "start"]
    assert [s["start_step"] for s in starts] == [0, 3]  # from step-3: the damaged step-6 never loaded
    assert [e["reason"] for e in ledger if e["event"] == "end"] == ["preempted", "completed"]
    # steps 4-6 trained again from step-3 give the very losses of the first time
    first, again = _losses(run_dir, 1), _losses(run_dir, 2)
    assert [again[s] for s in (4, 5, 6)] == [first[s] for s in (4, 5, 6)]
    # the new step-6 replaced the damaged one; keep_last=2 leaves 6 and 9
    assert [c.step for c in complete_checkpoints(ckpt_dir)] == [6, 9]
    assert not (ckpt_dir / "step-6" / CORRUPT_NAME).exists()

    # export: the newest damaged is said and skipped; asked for by step, refused with the file named
    _damage(ckpt_dir / "step-9" / damaged)
    code, out, err = _cli("export", run_dir, "--to", "hf", str(Path(run_dir) / "hf"))
    assert code == 0, out + err
    assert f"warning: step-9 does not hold what was written, not exported: {damaged}: " in err
    assert "step-6 (the newest whose files match their checksums)" in out
    code, out, err = _cli("export", run_dir, "--to", "hf", str(Path(run_dir) / "hf9"), "--step", "9")
    assert code == 2 and f"does not hold what was written: {damaged}: " in err, out + err


def _cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main([str(a) for a in args], Context(stdout=out, stderr=err, environ=dict(os.environ)))
    return code, out.getvalue(), err.getvalue()
