"""Which checkpoint a resume or an export uses, and why (lmcore.run.checkpoint_index.scan /
describe_choice, choose_for_resume, launcher.submit.lifecycle.resume_point): a resume reads the checksums
of the checkpoint it would start from (a damaged one is passed over, named); with no usable checkpoint it says so and
asks for --new instead of training from step 0 over the old step directories; a skipped newer
step directory is named with its reason; the continuation notice gives the step it really
continues from; a copied run directory reads its own checkpoints; a checkpoint file that cannot be
read is named."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from launcher.planning.resolve import resolve
from launcher.runs import registry as runs
from launcher.submit import lifecycle
from lmcore.digests import file_digest
from lmcore.errors import UserError
from lmcore.run import rundir
from lmcore.run.checkpoint_index import (
    CHECKSUM_ALGORITHM,
    choose_for_resume,
    complete_checkpoints,
    describe_choice,
    scan,
)


def _plan(repo, runs_root: Path, *overrides: str):
    environ = {"LMLAUNCH_RUNS_ROOT": str(runs_root), "HOME": "/home/u", "USER": "u"}
    return resolve(str(repo / "jobs" / "tiny-cpu.yaml"), list(overrides), cluster="local", environ=environ).plan


def _step(ckpt_dir: Path, step: int, *, complete: bool = True, manifest: dict[str, int] | None = None) -> Path:
    d = ckpt_dir / f"step-{step}"
    d.mkdir(parents=True)
    (d / "rank-0.pt").write_bytes(b"x" * 100)
    (d / "meta.json").write_text(json.dumps({"strategy": "ddp", "world_size": 2, "step": step}))
    if complete:
        files = {"rank-0.pt": 100} if manifest is None else manifest
        (d / "COMPLETE").write_text(json.dumps({"files": files}))
    return d


def _end(run_dir: Path, attempt: int, end_step: int) -> None:
    ledger = run_dir / rundir.LEDGER
    with ledger.open("a") as f:
        f.write(json.dumps({"event": "start", "attempt": attempt, "start_step": 0}) + "\n")
        f.write(json.dumps({"event": "end", "attempt": attempt, "end_step": end_step, "reason": "cancelled"}) + "\n")


def test_every_step_directory_that_is_not_a_complete_checkpoint_says_why(tmp_path):
    _step(tmp_path, 10)
    _step(tmp_path, 20, complete=False)
    _step(tmp_path, 30, manifest={"rank-0.pt": 120})
    _step(tmp_path, 40, manifest={"rank-0.pt": 100, "rank-1.pt": 100})
    found, skipped = scan(tmp_path)
    assert [c.step for c in found] == [10]
    reasons = {s.step: s.reason for s in skipped}
    assert reasons[20] == "no COMPLETE marker (its save did not finish)"
    assert reasons[30] == "rank-0.pt is 100 bytes, its manifest in COMPLETE says 120"
    assert reasons[40] == "rank-1.pt is missing (its manifest in COMPLETE names it)"
    text = describe_choice(tmp_path)
    assert text.startswith("step-10 (the newest complete checkpoint; skipped step-40: rank-1.pt is missing")
    assert "skipped step-20: no COMPLETE marker" in text and "skipped step-30: rank-0.pt is 100 bytes" in text
    assert describe_choice(tmp_path / "none") == "no complete checkpoint"


def test_a_mismatching_manifest_is_warned_about_once_per_process(tmp_path, caplog):
    _step(tmp_path, 10)
    _step(tmp_path, 20, manifest={"rank-0.pt": 7})
    with caplog.at_level(logging.WARNING, logger="lmtrain.checkpoint.manager"):
        for _ in range(4):
            assert [c.step for c in complete_checkpoints(tmp_path)] == [10]
    warned = [r for r in caplog.records if "do not match its manifest" in r.getMessage()]
    assert len(warned) == 1 and "rank-0.pt is 100 bytes" in warned[0].getMessage()


def test_a_resume_names_the_checkpoint_it_starts_from_and_the_newer_ones_it_skips(repo, tmp_path):
    plan = _plan(repo, tmp_path)
    lifecycle.plan_opening(plan).apply()
    ckpts = Path(plan.paths.checkpoint_dir)
    _step(ckpts, 10)
    _step(ckpts, 20, complete=False)
    opening = lifecycle.plan_opening(plan, resume=True)
    assert opening.notes[0] == (
        "resuming from step-10 (the newest complete checkpoint; skipped step-20: no COMPLETE marker "
        "(its save did not finish); written without checksums (an older lmtrain): its sizes were checked)"
    )


def _summed(ckpt_dir: Path, step: int, size: int = 100) -> Path:
    """A step directory whose COMPLETE records its files' sizes and checksums, as lmtrain writes it."""
    d = _step(ckpt_dir, step, manifest={"rank-0.pt": size})
    (d / "rank-0.pt").write_bytes(bytes(range(256)) * (size // 256) + b"x" * (size % 256))
    (d / "COMPLETE").write_text(json.dumps({"files": {"rank-0.pt": size}, "checksums": {
        "algorithm": CHECKSUM_ALGORITHM, "files": {"rank-0.pt": file_digest(d / "rank-0.pt")}}}))
    return d


def test_a_resume_checks_the_checksums_and_starts_from_the_newest_checkpoint_that_holds_what_was_written(repo, tmp_path):
    """Same-size damage passes the size check; --resume reads the checksums before submitting (up
    to LOGIN_VERIFY_BYTES) and names the checkpoint it passes over, the file and why. Nothing is
    changed: the job marks the damaged one as it loads."""
    plan = _plan(repo, tmp_path)
    lifecycle.plan_opening(plan).apply()
    ckpts = Path(plan.paths.checkpoint_dir)
    _summed(ckpts, 10)
    damaged = _summed(ckpts, 20)
    assert lifecycle.plan_opening(plan, resume=True).notes[0] == (
        "resuming from step-20 (the newest complete checkpoint; its files match their checksums)")
    with open(damaged / "rank-0.pt", "r+b") as f:  # zeroed in place: the size is unchanged
        f.seek(40)
        f.write(bytes(20))
    before = {p: p.read_bytes() for p in Path(plan.paths.run_dir).rglob("*") if p.is_file()}
    opening = lifecycle.plan_opening(plan, resume=True)
    note = opening.notes[0]
    assert note.startswith("resuming from step-10 (the newest whose files match; passed over step-20: its files do "
                           "not hold what was written (rank-0.pt: xxh3_128 "), note
    assert note.endswith("; its files match their checksums)"), note
    assert {p: p.read_bytes() for p in Path(plan.paths.run_dir).rglob("*") if p.is_file()} == before
    # past the budget, the ranks check it as they load it, and the line says so
    far = choose_for_resume(ckpts, verify_up_to=50)
    assert far.chosen is not None and far.chosen.step == 20
    assert far.why.endswith("its 0.0 GB are checked against their checksums by the ranks as they load it; a file "
                            "that differs makes it fall back to the previous one)"), far.why
    # every checkpoint damaged: nothing to resume from, and --new is what starts over
    with open(ckpts / "step-10" / "rank-0.pt", "r+b") as f:
        f.write(bytes(10))
    _end(Path(plan.paths.run_dir), 1, 20)
    with pytest.raises(UserError, match=r"nothing to resume from: it trained to step 20 but no checkpoint whose files "
                                        r"match their checksums \(passed over step-20: .*passed over step-10: .*--new"):
        lifecycle.plan_opening(plan, resume=True)


def test_a_resume_of_a_run_that_trained_but_has_no_complete_checkpoint_asks_for_new(repo, tmp_path):
    plan = _plan(repo, tmp_path)
    lifecycle.plan_opening(plan).apply()
    run_dir = Path(plan.paths.run_dir)
    _end(run_dir, 1, 20)
    with pytest.raises(UserError, match=r"nothing to resume from: it trained to step 20 but no complete checkpoint "
                                        r".*would train from step 0.*--new"):
        lifecycle.plan_opening(plan, resume=True)
    # step directories, none of them complete: the same, naming them, and nothing is changed
    _step(Path(plan.paths.checkpoint_dir), 20, complete=False)
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    with pytest.raises(UserError, match=r"no complete checkpoint \(skipped step-20: no COMPLETE marker"):
        lifecycle.plan_opening(plan, resume=True)
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
    # --new is what starts it over
    opening = lifecycle.plan_opening(plan, new=True)
    opening.apply()
    assert not (Path(plan.paths.checkpoint_dir) / "step-20").exists() and any("archived" in n for n in opening.notes)


def test_a_run_that_never_trained_resumes_at_step_0_and_says_so(repo, tmp_path):
    plan = _plan(repo, tmp_path)
    lifecycle.plan_opening(plan).apply()
    _end(Path(plan.paths.run_dir), 1, 0)  # cancelled before its first step
    opening = lifecycle.plan_opening(plan, resume=True)
    assert opening.notes[0] == "run 'tiny-cpu' has no checkpoint and never trained past step 0: it starts at step 0"


def test_continuing_a_finished_run_names_the_step_of_its_newest_complete_checkpoint(repo, tmp_path):
    plan = _plan(repo, tmp_path, "trainer.max_steps=20")
    lifecycle.plan_opening(plan).apply()
    run_dir = Path(plan.paths.run_dir)
    (run_dir / rundir.DONE).write_text("20\n")
    _step(Path(plan.paths.checkpoint_dir), 10)
    _step(Path(plan.paths.checkpoint_dir), 20, manifest={"rank-0.pt": 5})  # damaged: not complete
    longer = _plan(repo, tmp_path, "trainer.max_steps=30")
    opening = lifecycle.plan_opening(longer, resume=True)
    assert opening.continuation is not None and opening.continuation.startswith("continuing from step 10 to trainer.max_steps(30)")
    assert "skipped step-20: rank-0.pt is 100 bytes, its manifest in COMPLETE says 5" in opening.notes[0]


def test_a_copied_run_directory_reads_its_own_checkpoints(repo, tmp_path):
    plan = _plan(repo, tmp_path / "a")
    lifecycle.plan_opening(plan).apply()
    run_dir = Path(plan.paths.run_dir)
    _step(Path(plan.paths.checkpoint_dir), 10)
    copy = tmp_path / "b" / "copy"
    shutil.copytree(run_dir, copy)
    shutil.rmtree(Path(plan.paths.checkpoint_dir) / "step-10")
    assert rundir.checkpoint_dir_of(copy) == copy / "checkpoints"
    assert [c.path for c in complete_checkpoints(rundir.checkpoint_dir_of(copy))] == [copy / "checkpoints" / "step-10"]
    # a checkpoint.dir of its own, outside the run directory, stays where the plan says
    own = _plan(repo, tmp_path / "a", "name=own", f"checkpoint.dir={tmp_path / 'elsewhere'}")
    lifecycle.plan_opening(own).apply()
    assert rundir.checkpoint_dir_of(own.paths.run_dir) == tmp_path / "elsewhere"


def test_a_truncated_checkpoint_file_behind_an_old_style_complete_is_named(tmp_path):
    import torch

    from lmtrain.checkpoint.weights import UnreadableCheckpoint, lightning_state_dict

    step = tmp_path / "step-5"
    step.mkdir()
    torch.save({"state_dict": {"model.w": torch.ones(1000)}}, step / "lightning.ckpt")
    (step / "COMPLETE").write_text("ok\n")  # older lmtrain: no manifest, trusted as it is
    assert torch.equal(lightning_state_dict(step)["model.w"], torch.ones(1000))
    data = (step / "lightning.ckpt").read_bytes()
    (step / "lightning.ckpt").write_bytes(data[: len(data) // 2])
    with pytest.raises(UnreadableCheckpoint, match=rf"{step / 'lightning.ckpt'} \({len(data) // 2:,} bytes\) is not a whole torch file"):
        lightning_state_dict(step)


def test_a_local_run_named_without_its_directory_is_pointed_to_it(tmp_path):
    root = tmp_path / "runs"
    (root / "mine").mkdir(parents=True)
    (root / "mine" / "plan.json").write_text("{}")
    environ = {"LMLAUNCH_HOME": str(tmp_path / "home"), "LMLAUNCH_RUNS_ROOT": str(root)}
    with pytest.raises(UserError, match=rf"known runs: none; {root / 'mine'} is a run directory \(a local run\): name it by that path"):
        runs.find_run("mine", environ)
