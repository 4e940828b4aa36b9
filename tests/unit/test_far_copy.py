"""A run's copy on a cluster reached over SSH (launcher.runs.far_copy), without ssh: the other side
is a directory of this machine (``login`` empty: the same rsync and the same `lmlaunch _checkpoint`
there), so what travels, what is checked against the manifest and what comes back is real.
tests/integration/test_several_clusters.py runs it over a real sshd between two SLURM clusters."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from launcher.commands.history import attempt_cluster
from launcher.runs import far_copy
from launcher.runs.registry import RunRecord
from lmcore import digests
from lmcore.run import checkpoint_index, run_layout
from lmcore.slurm import client as slurm
from lmcore.slurm.commands_target import CommandsTarget

LMLAUNCH = str(Path(sys.executable).parent / "lmlaunch")


def _checkpoint(ckpt_dir: Path, step: int, payload: bytes = b"weights") -> Path:
    """A complete step directory as lmtrain writes it: its files, then COMPLETE with their sizes and checksums."""
    d = ckpt_dir / checkpoint_index.step_dir_name(step)
    d.mkdir(parents=True)
    (d / "rank-0.pt").write_bytes(payload * 100)
    (d / "meta.json").write_text(json.dumps({"step": step}))
    files = {p.name: p.stat().st_size for p in d.iterdir()}
    sums = {"algorithm": checkpoint_index.CHECKSUM_ALGORITHM,
            "files": {name: digests.file_digest(d / name) for name in files}}
    (d / checkpoint_index.COMPLETE_NAME).write_text(json.dumps({"step": step, "files": files, "checksums": sums}))
    return d


def _run(tmp_path: Path) -> tuple[Path, far_copy.FarRun]:
    here = tmp_path / "here" / "r1"
    (here / "logs").mkdir(parents=True)
    (here / "spec.yaml").write_text("name: r1\n")
    (here / run_layout.LEDGER).write_text('{"event": "start", "attempt": 1}\n{"event": "end", "attempt": 1}\n')
    (here / "logs" / run_layout.MOVER_LOG).write_text("the watcher's own\n")
    (here / run_layout.MOVER_LOCK).write_text("")
    (here / "submitit").mkdir()
    (here / "submitit" / "7_0_log.out").write_text("this cluster's job 7\n")
    (here / "rendezvous").mkdir()
    (here / "rendezvous" / "7-0.gate.json").write_text("{}")
    far = far_copy.FarRun("centre", (), str(tmp_path / "there" / "r1"), LMLAUNCH, "there")
    return here, far


def test_a_push_carries_the_run_and_its_newest_checkpoint_checked_there_and_nothing_kept_by_job_id(tmp_path):
    here, far = _run(tmp_path)
    step = _checkpoint(here / "checkpoints", 20)
    _checkpoint(here / "checkpoints", 10)
    far_copy.push(here, far, step)
    there = Path(far.run_dir)
    assert (there / "spec.yaml").read_text() == "name: r1\n"
    assert (there / run_layout.LEDGER).read_text() == (here / run_layout.LEDGER).read_text()
    assert sorted(p.name for p in (there / "checkpoints").iterdir()) == ["latest", "step-20"]  # the newest only
    assert (there / "checkpoints" / "latest").read_text() == "step-20\n"
    assert checkpoint_index.verify(there / "checkpoints" / "step-20") == []
    # another cluster numbers its jobs on its own: this one's job-7 files must not meet its job 7
    assert not (there / "submitit" / "7_0_log.out").exists() and not (there / "rendezvous").exists()
    assert not (there / run_layout.MOVER_LOCK).exists() and not (there / "logs" / run_layout.MOVER_LOG).exists()


def test_a_copy_unlike_its_checksums_is_refused_and_removed_never_named(tmp_path):
    here, far = _run(tmp_path)
    step = _checkpoint(here / "checkpoints", 20)
    with open(step / "rank-0.pt", "r+b") as f:  # a bit flipped after COMPLETE was written: same size
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 1]))
    with pytest.raises(far_copy.CopyFailed, match=r"the copy of checkpoint step-20 on centre does not match its "
                                                  r"checksums \(rank-0.pt: xxh3_128 \w+ differs from the \w+ written\): "
                                                  r"removed there"):
        far_copy.push(here, far, step)
    assert list((Path(far.run_dir) / "checkpoints").iterdir()) == []  # neither step-20 nor its temporary


def test_a_pull_brings_back_newer_files_merges_the_ledger_and_checks_the_checkpoint_here(tmp_path):
    here, far = _run(tmp_path)
    far_copy.push(here, far, None)
    there = Path(far.run_dir)
    with open(there / run_layout.LEDGER, "a") as f:  # the attempt there: its lines after this side's
        f.write('{"event": "start", "attempt": 2, "job_id": "7"}\n{"event": "end", "attempt": 2}\n{"event": "st')
    (there / run_layout.DONE).write_text("80\n")
    (there / "submitit").mkdir(exist_ok=True)
    (there / "submitit" / "7_0_log.out").write_text("the other cluster's job 7\n")
    (there / "submitit" / "9_0_log.out").write_text("its job 9\n")
    (there / "logs" / "attempt-2").mkdir(parents=True)
    (there / "logs" / "attempt-2" / "rank-0.log").write_text("trained there\n")
    (there / "spec.yaml").write_text("name: r1\ncluster: there\n")  # its own plan: never over this one's
    _checkpoint(there / "checkpoints", 80)
    with open(here / run_layout.LEDGER, "a") as f:  # written here meanwhile (the watcher's move line)
        f.write('{"event": "moved", "to": "centre"}\n')

    assert far_copy.pull(here, far) is None
    assert (here / run_layout.LEDGER).read_text().splitlines() == [
        '{"event": "start", "attempt": 1}', '{"event": "end", "attempt": 1}', '{"event": "moved", "to": "centre"}',
        '{"event": "start", "attempt": 2, "job_id": "7"}', '{"event": "end", "attempt": 2}']  # the torn line waits
    assert (here / "spec.yaml").read_text() == "name: r1\n"
    # DONE here is the watcher's, once the job there ended and everything came back (launcher.submit.watcher)
    assert not (here / run_layout.DONE).exists() and far_copy.done_there(far) == "80\n"
    assert (here / "logs" / "attempt-2" / "rank-0.log").read_text() == "trained there\n"
    assert (here / "logs" / run_layout.MOVER_LOG).read_text() == "the watcher's own\n"
    assert (here / "submitit" / "7_0_log.out").read_text() == "this cluster's job 7\n"  # kept: another job 7
    assert (here / "submitit" / "on-centre" / "7_0_log.out").read_text() == "the other cluster's job 7\n"
    assert (here / "submitit" / "on-centre" / "9_0_log.out").read_text() == "its job 9\n"
    assert not (here / "checkpoints").exists()  # not asked for

    assert far_copy.pull(here, far, checkpoint=True) == "step-80"
    assert checkpoint_index.verify(here / "checkpoints" / "step-80") == []
    assert (here / run_layout.LEDGER).read_text().count('"attempt": 2') == 2  # merged once
    (here / "checkpoints" / "step-80" / "meta.json").write_text(json.dumps({"step": 81}))  # damaged here since
    assert far_copy.pull(here, far, checkpoint=True) == "step-80"
    assert checkpoint_index.verify(here / "checkpoints" / "step-80") == []  # brought again, whole


def test_another_runs_copy_of_the_name_is_set_aside_never_resumed_from(tmp_path):
    """A run of the same name copied there before (an earlier run, or this name before --new): its
    checkpoints and ledger lines are not this run's."""
    here, far = _run(tmp_path)
    assert far_copy.set_aside(far) is None  # nothing there yet
    far_copy.push(here, far, _checkpoint(here / "checkpoints", 500))
    far_copy.push(here, far, None)  # this run's own copy: kept
    assert (Path(far.run_dir) / "checkpoints" / "step-500").is_dir()
    shutil.rmtree(here)  # `submit --new` here: a new directory of the name
    again, _ = _run(tmp_path)
    far_copy.push(again, far, _checkpoint(again / "checkpoints", 20))
    assert sorted(p.name for p in (Path(far.run_dir) / "checkpoints").iterdir()) == ["latest", "step-20"]
    kept = [p for p in Path(far.run_dir).parent.iterdir() if p.name.startswith("r1.archived-")]
    assert len(kept) == 1 and (kept[0] / "checkpoints" / "step-500" / checkpoint_index.COMPLETE_NAME).exists()


def test_a_pulled_checkpoint_unlike_its_checksums_is_removed_here(tmp_path):
    here, far = _run(tmp_path)
    far_copy.push(here, far, None)
    step = _checkpoint(Path(far.run_dir) / "checkpoints", 30)
    (step / "meta.json").write_text(json.dumps({"step": 31}))  # same size, other bytes
    with pytest.raises(far_copy.CopyFailed, match="from centre does not match its checksums .*: removed here"):
        far_copy.pull(here, far, checkpoint=True)
    assert list((here / "checkpoints").iterdir()) == []


def test_merging_a_ledger_appends_only_the_lines_it_lacks_in_their_order(tmp_path):
    path = tmp_path / "attempts.jsonl"
    assert far_copy.merge_ledger(path, "a\nb\n") == 2
    assert far_copy.merge_ledger(path, "a\nb\nc\nd") == 1  # d: being written
    assert path.read_text() == "a\nb\nc\n"


def test_a_runs_root_there_is_made_and_read_back_absolute(tmp_path):
    assert far_copy.resolve_root((), str(tmp_path / "r r" / "runs"), "centre") == str(tmp_path / "r r" / "runs")
    assert (tmp_path / "r r" / "runs").is_dir()
    assert far_copy.resolve_root((), "~/runs", "centre") == str(Path(os.environ["HOME"]).resolve() / "runs")


def test_slurm_commands_of_a_cluster_over_ssh_run_in_its_login_shell_with_its_conf_and_clients(tmp_path):
    """``login`` is the ssh command line up to the destination; here ``bash -c`` stands in for it."""
    bin_dir = tmp_path / "slurm-bin"
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text('#!/bin/sh\necho "conf=$SLURM_CONF args=$*"\n')
    (bin_dir / "squeue").chmod(0o755)
    target = CommandsTarget(conf="/etc/slurm-far/slurm.conf", bin=str(bin_dir), profile="centre", login=("bash", "-c"))
    assert CommandsTarget.from_json(json.loads(json.dumps(target.to_json()))) == target
    assert "over ssh to -c" in target.where and target.environ({"PATH": "/usr/bin"}) == {"PATH": "/usr/bin"}
    with slurm.through_commands(target):
        out = slurm.run(["squeue", "-h", "--me"]).stdout
    assert out == "conf=/etc/slurm-far/slurm.conf args=-h --me\n"
    home = tmp_path / "far-home"  # paths of that machine: its ~, not this one's
    (home / "bin").mkdir(parents=True)
    (home / "bin" / "squeue").write_text((bin_dir / "squeue").read_text())
    (home / "bin" / "squeue").chmod(0o755)
    there = CommandsTarget(conf="~/slurm.conf", bin="~/bin", profile="centre", login=("env", f"HOME={home}", "bash", "-c"))
    with slurm.through_commands(there):
        assert slurm.run(["squeue"]).stdout == f"conf={home}/slurm.conf args=\n"


def test_an_attempt_is_named_by_the_cluster_its_start_line_names_even_when_job_ids_meet():
    rec = RunRecord(name="r", profile="here", run_dir="/x", spec_path=None, job_ids=["7", "7"], job_profiles=["here", "centre"],
                    targets={"centre": {"via": "commands", "far": {"cluster": "centre", "profile": "there",
                                                                  "run_dir": "/far/r"}}})
    assert attempt_cluster(rec, "here", "7") == "here"
    assert attempt_cluster(rec, "there", "7") == "centre"  # planned there on its own profile
    assert attempt_cluster(rec, None, "7") == "centre"  # an older start line: its job's newest cluster
    assert far_copy.of_record(rec, "7") == far_copy.FarRun("centre", (), "/far/r", "lmlaunch", "there")
