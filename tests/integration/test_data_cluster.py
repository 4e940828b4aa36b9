"""`lmlaunch data prepare --on-cluster` on the local cluster: the shipped corpus split into
.jsonl.zst, parquet and .jsonl.gz files is prepared by a 3-task array, really preempted in the
middle (a high-priority exclusive job requeues every running task); the preempted tasks keep the
shards they had finished (never rewritten) and redo only the rest; the final step's store equals
the local preparation of the same inputs byte for byte; `status` shows the run's progress and
`logs --rank K` each task's attempts. More tasks than one array holds run as arrays chained one
after another; a corrupt input fails its task with the file named in `status` and `logs`, and the
final step is cancelled rather than left pending."""

from __future__ import annotations

import filecmp
import re
import subprocess
from pathlib import Path

import waiting
from slurm_helpers import faults, gate, wait_for

from lmcore.slurm import admin as rehearsal, client as slurm
from lmtrain.data.prepare.build import prepare, read_meta
from tests.unit.test_corpus_inputs import shipped_documents, write


def _split(d: Path) -> Path:
    d.mkdir()
    docs, kinds = shipped_documents(), [".jsonl.zst", ".parquet", ".jsonl.gz"]
    for i in range(6):
        write(d / f"part-{i}{kinds[i % 3]}", docs[i * len(docs) // 6:(i + 1) * len(docs) // 6])
    return d


def _same_tree(a: Path, b: Path) -> list[str]:
    cmp = filecmp.dircmp(a, b)
    out = [*cmp.left_only, *cmp.right_only, *cmp.diff_files, *cmp.funny_files]
    for sub in cmp.common_dirs:
        out += [f"{sub}/{x}" for x in _same_tree(a / sub, b / sub)]
    return out


def test_a_preparation_array_preempted_midway_redoes_only_unfinished_shards(slurm_cluster, cli, lm_env, run_name,
                                                                           own_jobs, tmp_path):
    corpus, out = _split(tmp_path / "corpus"), tmp_path / "store"
    # every task held before its second shard until the preemption has landed (its SIGTERM ends the wait:
    # the task's handler raises), then released for the requeued attempts
    released = tmp_path / "released"
    with faults(gate("prepare.shard", released, nth=2)):
        r = cli("data", "prepare", str(corpus), "--out", str(out), "--on-cluster", "--tasks", "3",
                "--max-parallel", "3", "--name", run_name)
    assert r.code == 0, r.err
    array, assemble = re.search(r"array job (\d+) \(3 tasks over 6 files, 3 at once", r.out).group(1), \
        re.search(r"then job (\d+) writes the index", r.out).group(1)
    own_jobs += [array, assemble]
    staging = tmp_path / "store.partial"
    first = staging / "shards" / "00000.json"
    # task 0 finished its first shard and is held before its second
    waiting.until(first.exists, progress=waiting.watching(waiting.tree(tmp_path), waiting.queue()), poll=0.2,
                  what="task 0's first shard")
    kept = (staging / "shards" / "00000.bin").stat()
    assert not (staging / "shards" / "00001.json").exists()
    nodes = sorted({j.nodelist for j in slurm.squeue() if j.job_id.startswith(f"{array}_") and j.nodelist})
    high = rehearsal.submit_holder(name=f"{run_name}-hi", partition="high", nodelist=",".join(nodes),
                                   num_nodes=len(nodes), seconds=2)
    own_jobs.append(high)
    waiting.until(lambda: slurm.state_group(slurm.job_state(f"{array}_0")) != "running", poll=0.2,
                  progress=waiting.watching(waiting.job(f"{array}_0"), waiting.queue()), what="task 0 preempted")
    released.touch()
    for k in range(3):  # requeued tasks restart (their requeue delay cut short), then the final step
        wait_for(f"{array}_{k}", {"completed"}, poll=0.5, start_requeued=True)
    assert wait_for(assemble, {"completed", "failed", "cancelled"}) == "COMPLETED"

    after = (out / "shards" / "00000.bin").stat()
    assert (after.st_ino, after.st_mtime_ns) == (kept.st_ino, kept.st_mtime_ns)  # never rewritten
    logs = cli("logs", run_name, "--rank", "0")
    assert logs.code == 0, logs.err
    assert "attempt 2" in logs.out and "kept shards/00000.bin (finished by an earlier attempt" in logs.out, logs.out
    assert "1 shards of all were finished when it started" not in logs.out.split("attempt 2")[0]
    local = prepare([corpus], tmp_path / "local").out
    assert _same_tree(local, out) == []  # byte for byte: shards, their records, the index
    assert not staging.exists()
    status = cli("status", run_name)
    assert status.code == 0 and "COMPLETED" in status.out and "6/6" in status.out, status.out


def _sacct_times(job: str) -> list[tuple[str, str]]:
    """(start, end) of each task of array ``job`` (ISO times sort as text)."""
    out = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobID,Start,End", "-j", job], capture_output=True, text=True,
                         check=True).stdout
    return [(start, end) for line in out.splitlines() if line.strip() for _, start, end in [line.split("|")]]


def test_more_tasks_than_an_array_holds_run_as_chained_arrays_and_a_bad_input_fails_its_task_clearly(
        slurm_cluster, cli, lm_env, run_name, own_jobs, tmp_path):
    corpus, docs = tmp_path / "corpus", shipped_documents()
    corpus.mkdir()
    for i in range(4):
        write(corpus / f"part-{i}.jsonl.zst", docs[i * len(docs) // 4:(i + 1) * len(docs) // 4])
    r = cli("data", "prepare", str(corpus), "--out", str(tmp_path / "store"), "--on-cluster", "--tasks", "4",
            "--max-parallel", "2", "--array-size", "2", "--name", run_name)
    assert r.code == 0, r.err
    first, second = re.search(r"array jobs (\d+), (\d+) \(at most 2 tasks each, each starting when the one before",
                              r.out).groups()
    assemble = re.search(r"then job (\d+) writes the index", r.out).group(1)
    own_jobs += [first, second, assemble]
    assert wait_for(assemble, {"completed", "failed", "cancelled"}) == "COMPLETED"
    assert max(end for _, end in _sacct_times(first)) <= min(start for start, _ in _sacct_times(second))  # chained
    assert _same_tree(prepare([corpus], tmp_path / "local").out, tmp_path / "store") == []
    status = cli("status", run_name)
    m = read_meta(tmp_path / "store")
    assert status.code == 0 and "COMPLETED" in status.out and "4/4" in status.out, status.out
    assert f"{m.num_documents:,} documents, {m.num_tokens:,} tokens in the store" in status.out, status.out

    bad = corpus / "part-2.jsonl.zst"  # corrupt in the middle of its stream: task 1's first file
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    name = f"{run_name}-bad"
    r = cli("data", "prepare", str(corpus), "--out", str(tmp_path / "store2"), "--on-cluster", "--tasks", "2",
            "--array-size", "1", "--name", name)
    assert r.code == 0, r.err
    arrays = re.search(r"array jobs (\d+), (\d+) ", r.out).groups()
    assemble = re.search(r"then job (\d+) writes the index", r.out).group(1)
    own_jobs += [*arrays, assemble]
    assert wait_for(assemble, {"completed", "failed", "cancelled"}) == "CANCELLED"  # by the failed task
    assert wait_for(f"{arrays[1]}_0", {"completed", "failed", "cancelled"}) == "FAILED"
    assert wait_for(f"{arrays[0]}_0", {"completed", "failed", "cancelled"}) == "COMPLETED"
    status = cli("status", name)
    assert status.code == 0 and re.search(r"task 1 failed: \S*part-2\.jsonl\.zst: not a readable \.jsonl\.zst stream",
                                          status.out), status.out
    logs = cli("logs", name, "--rank", "1")
    assert "not a readable .jsonl.zst stream" in logs.out and "cancelled the final step" in logs.out, logs.out
    kept = sorted(p.name for p in (tmp_path / "store2.partial" / "shards").glob("*.json"))
    assert kept == ["00000.json", "00001.json"] and not (tmp_path / "store2").exists()  # task 0's, for a rerun
