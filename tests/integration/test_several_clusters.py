"""One run over two real SLURM clusters side by side, sharing the runs root: this worker's own
cluster (the machine's SLURM) and a worker cluster of the other Debian release's SLURM (24.11 on
Debian 12, 22.05 on Debian 13), each profile read off its live cluster by `lmlaunch profile init`
(which writes the way to it: submit.slurm_conf and slurm_bin).

- Placement: with the first cluster's nodes held, the dry run shows both clusters' start
  estimates (and a third, unreachable, skipped within the bound), and the run lands on the second.
- Moving on preemption: placed on the first, preempted there; the watcher submit started holds and
  cancels the requeued job and submits it on the second; the run ends bit-identical to an
  uninterrupted one, `history` lists both clusters' attempts with their job ids, `status` and
  `cancel` reach the cluster that holds it.
- Moving after a wait: queued on the first past move.after while the second frees up: it moves,
  and the job it left is gone from the first queue.
- Over SSH: the second cluster reached through a real sshd (tests/integration/sshd_helpers.py), its
  lmlaunch with its own home and runs root (nothing shared): placed there when the first is held;
  preempted on the first, the copy of its checkpoint damaged on the way (the move abandoned, the
  job left queued where it was, said in status), then copied whole: it ends there bit-identical,
  and its files and final checkpoint come back into the run's directory here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import sshd_helpers
import waiting
from preempt_helpers import (
    BASE,
    SPEC,
    assert_losses_match,
    assert_weights_identical,
    ddp_reference,
    ends,
    held_at,
    ledger,
    lm,
    log_tail,
    starts,
    submit,
    wait_held,
)
from shared_results import shared
from slurm_helpers import job_name, release_worker, wait_nodes_usable

from launcher.localcluster import cluster, workers
from launcher.localcluster.config import SLURM_RELEASES, other_version
from lmcore.slurm import admin, client as slurm

pytestmark = pytest.mark.skipif(os.environ.get("LMLAUNCH_TEST_OTHER_SLURM") == "0",
                                reason="LMLAUNCH_TEST_OTHER_SLURM=0: the other SLURM version's clusters were left out "
                                       "on purpose, and this test needs one")
MOVE = "move={poll_s: 1}"


@pytest.fixture(scope="module")
def jobs(module_jobs):
    return module_jobs


@pytest.fixture(scope="module")
def two(slurm_cluster, tmp_path_factory):
    """(environment, the other cluster's claim): profiles 'here' (this worker's cluster) and
    'there' (the other version's) read off the live clusters, and 'gone' (a controller that does
    not answer), in a private LMLAUNCH_HOME; one runs root."""
    version = other_version()
    assert version in SLURM_RELEASES, version
    claim = workers.claim(version)
    root = tmp_path_factory.mktemp("two")
    env = {**os.environ, "LMLAUNCH_HOME": str(root / "home"), "LMLAUNCH_RUNS_ROOT": str(root / "runs"),
           "LMLAUNCH_CLUSTER_ANSWER_S": "3"}
    try:
        lines: list[str] = []
        cluster.up(lines.append, layout=claim.layout, ports=claim.ports, system_conf=False, version=version,
                   accounting=True, min_job_age=300, preempt_send_user_signal=False, nodes=2, topology="none")
        code, out, err = lm(env, "profile", "init", "here")
        assert code == 0, out + err
        code, out, err = lm({**env, **cluster.environ_of(claim.layout, version)}, "profile", "init", "there")
        assert code == 0, out + err
        profiles = root / "home" / "profiles"
        there = (profiles / "there.yaml").read_text()
        assert f'slurm_conf: "{claim.layout.slurm_conf}"' in there and f'slurm_bin: "{claim.layout.bin}"' in there
        conf = slurm.slurm_env().get("SLURM_CONF") or "/etc/slurm/slurm.conf"  # this worker's cluster's
        dead = root / "dead.conf"  # its configuration with a controller port nobody listens on
        dead.write_text(re.sub(r"SlurmctldPort=\d+", "SlurmctldPort=9", Path(conf).read_text()))
        here = [line for line in (profiles / "here.yaml").read_text().splitlines()
                if not line.startswith(("submit:", "  slurm_conf:", "  slurm_bin:"))]
        (profiles / "gone.yaml").write_text("\n".join([*here, "submit:", f'  slurm_conf: "{dead}"']) + "\n")
        yield env, claim
    finally:
        release_worker(claim, "mc-")


def _on_there(claim):
    return cluster.own_conf(claim.layout)


def _job(out: str) -> str:
    return re.search(r"job (\d+)", out).group(1)


def _wait_done(run_dir: Path, what: str) -> None:
    waiting.until(lambda: (run_dir / "DONE").exists(), progress=lambda: (len(ledger(run_dir)), run_dir.stat().st_mtime),
                  what=what, explain=lambda: log_tail(run_dir) + _mover_log(run_dir))


def _running(job: str) -> None:
    """Until ``job`` (a holder) runs: the nodes it holds may still be completing the last test's job."""
    waiting.until(lambda: slurm.job_state(job) == "RUNNING", progress=lambda: slurm.job_state(job),
                  what=f"holder {job} running")


def _mover_log(run_dir: Path) -> str:
    path = run_dir / "logs" / "mover.log"
    return "\n--- mover.log\n" + (path.read_text()[-3000:] if path.exists() else "(none)")


def _dry_run_with_here_held(env: dict[str, str], name: str, clusters: str) -> str:
    """`submit --dry-run` over ``clusters`` while the first cluster's nodes are held: its output."""
    holder = admin.submit_holder(name=f"{name}-hold", partition="high", nodelist="n[1-2]", num_nodes=2, seconds=600)
    try:
        _running(holder)
        code, out, err = lm(env, "submit", SPEC, f"name={name}", *BASE, f"clusters={clusters}", "--dry-run")
        assert code == 0, out + err
        assert re.search(r"#   here: starts \S+ \(\d+ min from now\)", out), out[:1500]
        return out
    finally:
        slurm.cancel([holder])


def test_a_run_is_placed_where_it_starts_soonest_moves_when_preempted_and_ends_bit_identical(two, jobs):
    env, claim = two
    reference = shared("preempt-ddp-reference", lambda: ddp_reference(env, jobs))
    name = job_name("mc", "placed")
    run_dir = Path(env["LMLAUNCH_RUNS_ROOT"]) / name
    out = _dry_run_with_here_held(env, name, "[here, gone, there]")
    assert "#   gone: skipped: " in out and "#   there: starts " in out and "(now)" in out, out[:1500]
    assert "# chosen: there (it starts soonest)" in out, out[:1500]
    assert "on cluster 'there'" in out
    assert not run_dir.exists()  # a dry run changes nothing
    # a node out of service on the cluster named first: it would queue the job to wait (no start
    # estimate), not refuse it, and the run goes where it starts now
    with _on_there(claim):
        admin.set_node_state("n2", "DRAIN", "several-clusters test")
    try:
        code, out, err = lm(env, "submit", SPEC, f"name={name}", *BASE, "clusters=[there, here]", "--dry-run")
    finally:
        with _on_there(claim):
            admin.set_node_state("n2", "RESUME")
        wait_nodes_usable(layout=claim.layout)
    assert code == 0 and "#   there: takes it, no start estimate (queued, it would wait (" in out, out[:1500] + err
    assert "out of service: n2 (drain" in out and "# chosen: here (it starts soonest)" in out, out[:1500]

    # both free: placed on the first named; preempted there, it moves to the other (steps paced)
    first, run_dir = submit(env, name, "clusters=[here, there]", MOVE, holds=(held_at(16),))  # until preempted
    jobs.append(first)
    wait_held(run_dir, 16)
    code, out, err = lm(env, "preempt", name, "--mode", "requeue")
    assert code == 0, out + err
    _wait_done(run_dir, f"run {name} moved and done")
    moved = [e for e in ledger(run_dir) if e.get("event") == "moved"]
    assert len(moved) == 1 and (moved[0]["from"], moved[0]["from_job"], moved[0]["to"], moved[0]["why"]) == \
        ("here", first, "there", "preempted"), moved
    second = moved[0]["to_job"]
    assert [s["job_id"] for s in starts(run_dir)] == [first, second]
    assert [e["reason"] for e in ends(run_dir)] == ["preempted", "completed"]
    assert starts(run_dir)[1]["start_step"] == ends(run_dir)[0]["end_step"]  # from the stop checkpoint
    assert_losses_match(run_dir, reference["losses"])
    assert_weights_identical(run_dir, reference)
    assert not [j for j in slurm.squeue([first]) if j.job_id == first and slurm.is_active(j.state)]
    with _on_there(claim):  # its batch script ends a moment after the DONE marker
        assert waiting.until(lambda: slurm.state_group(slurm.job_state(second)) not in ("queued", "running"),
                             progress=lambda: slurm.job_state(second), what=f"job {second} ended") \
            and slurm.job_state(second) == "COMPLETED"
    code, out, err = lm(env, "history", name, "--json")
    rows = json.loads(out)["attempts"]
    assert [(r["job_id"], r["cluster"]) for r in rows] == [(first, "here"), (second, "there")], rows
    assert any("moved from here (job" in n and "to there (job" in n for n in json.loads(out)["notes"])
    code, out, err = lm(env, "status", "--json")
    row = next(r for r in json.loads(out)["runs"] if r["name"] == name)
    assert (row["job_id"], row["state"]) == (second, "COMPLETED"), row


def test_a_queued_run_past_move_after_moves_and_leaves_no_job_behind(two, jobs):
    env, claim = two
    name = job_name("mc", "waited")
    run_dir = Path(env["LMLAUNCH_RUNS_ROOT"]) / name
    here_hold = admin.submit_holder(name=f"{name}-hold", partition="high", nodelist="n[1-2]", num_nodes=2, seconds=240)
    with _on_there(claim):
        there_hold = admin.submit_holder(name=f"{name}-hold", partition="high", nodelist="n[1-2]", num_nodes=2,
                                         seconds=1800)
    try:
        _running(here_hold)
        with _on_there(claim):
            _running(there_hold)
        code, out, err = lm(env, "submit", SPEC, f"name={name}", *BASE, "trainer.max_steps=10", "clusters=[here, there]",
                            "move={poll_s: 1, after: '0:10', on_preemption: false}")
        assert code == 0, out + err
        assert "chosen: here (it starts soonest)" in out, out
        first = _job(out)
        jobs.append(first)
        with _on_there(claim):
            slurm.cancel([there_hold])
        _wait_done(run_dir, f"run {name} moved after its wait and done")
    finally:
        slurm.cancel([here_hold])
        with _on_there(claim):
            slurm.cancel([there_hold])
    moved = [e for e in ledger(run_dir) if e.get("event") == "moved"]
    assert len(moved) == 1 and moved[0]["from_job"] == first and moved[0]["to"] == "there", moved
    assert moved[0]["why"].startswith("queued ") and "(move.after 10 s)" in moved[0]["why"], moved
    assert not [j for j in slurm.squeue([first]) if j.job_id == first and slurm.is_active(j.state)]
    assert slurm.job_state(first) == "CANCELLED"
    assert [s["job_id"] for s in starts(run_dir)] == [moved[0]["to_job"]]  # the first never started
    assert ends(run_dir)[-1]["reason"] == "completed" and ends(run_dir)[-1]["end_step"] == 10


def test_a_sweep_spreads_its_points_over_both_clusters_with_one_max_parallel(two, jobs, tmp_path):
    env, claim = two
    name = job_name("mc", "spread")
    grid = tmp_path / "sweep.yaml"
    grid.write_text(f"name: {name}\nmax_parallel: 2\ngrid:\n  optim.lr: [0.001, 0.002]\n")
    args = (SPEC, grid, *BASE, "trainer.max_steps=10", "clusters=[here, there]")
    code, out, err = lm(env, "sweep", *args, "--dry-run")
    assert code == 0, out + err
    assert f"# sweep '{name}': 2 points, one SLURM array on each of 2 clusters, at most 2 at once" in out, out[:2000]
    assert "# here: points 0, at most 1 at once" in out and "# there: points 1, at most 1 at once" in out, out[:2000]
    assert "## array job script (as submitted) on there" in out
    code, out, err = lm(env, "sweep", *args)
    assert code == 0, out + err
    sweep_dir = Path(env["LMLAUNCH_RUNS_ROOT"]) / name
    placed = json.loads((sweep_dir / "sweep.json").read_text())["clusters"]
    assert {c: v["points"] for c, v in placed.items()} == {"here": [f"{name}.0"], "there": [f"{name}.1"]}, placed
    points = [Path(env["LMLAUNCH_RUNS_ROOT"]) / f"{name}.{i}" for i in (0, 1)]
    for run_dir in points:
        _wait_done(run_dir, f"sweep point {run_dir.name} done")

    def rows() -> dict:  # each point's state from its own cluster (the batch script ends just after DONE)
        return {r["name"]: (r["cluster"], r["state"]) for r in json.loads(lm(env, "status", name, "--json")[1])["runs"]}

    want = {f"{name}.0": ("here", "COMPLETED"), f"{name}.1": ("there", "COMPLETED")}
    waiting.until(lambda: rows() == want, progress=rows, what="both points COMPLETED on their clusters", poll=1.0)
    assert (sweep_dir / "on-there" / "submitit").is_dir() and (sweep_dir / "on-here" / "submitit").is_dir()


# the lmlaunch on the login node; while DAMAGE exists, a checkpoint copied there arrives with a changed byte
WRAPPER = """#!/bin/bash
if [ "$1" = _checkpoint ] && [ "$2" = accept ] && [ -e {damage} ]; then
  printf X | dd of="$3/meta.json" bs=1 count=1 conv=notrunc status=none
fi
exec {lmlaunch} "$@"
"""


@pytest.fixture(scope="module")
def over_ssh(two, tmp_path_factory):
    """(environment, the damage switch, the runs root there): profile 'viassh' is the other cluster
    ('there') reached through a real sshd, where an lmlaunch of its own home and runs root submits."""
    env, _ = two
    root = tmp_path_factory.mktemp("ssh")
    sockets = Path(tempfile.mkdtemp(prefix="lmcm-", dir="/tmp"))  # a Unix socket's path: at most 107 bytes
    node = sshd_helpers.start(root / "login")
    far_home, far_runs = root / "far-home", root / "far-runs"
    (far_home / "profiles").mkdir(parents=True)
    there = (Path(env["LMLAUNCH_HOME"]) / "profiles" / "there.yaml").read_text()
    (far_home / "profiles" / "there.yaml").write_text(there)
    damage, wrapper = root / "damage", root / "lmlaunch-there"
    wrapper.write_text(WRAPPER.format(damage=damage, lmlaunch=Path(sys.executable).parent / "lmlaunch"))
    wrapper.chmod(0o755)
    kept = [line for line in there.splitlines() if not line.startswith("runs_root:")]
    (Path(env["LMLAUNCH_HOME"]) / "profiles" / "viassh.yaml").write_text("\n".join([
        *kept, f"runs_root: {far_runs}", "login:", "  ssh: cluster-login", f"  lmlaunch: {wrapper}",
        f"  control_path: {sockets}/cm-%C", "  profile: there",
        f"  options: [-F, {node.config}, -o, 'SetEnv=LMLAUNCH_HOME={far_home}']"]) + "\n")
    try:
        yield env, damage, far_runs
    finally:
        node.stop()
        shutil.rmtree(sockets, ignore_errors=True)


def test_a_run_moves_to_a_cluster_over_ssh_its_checkpoint_copied_checked_and_brought_back(over_ssh, jobs):
    env, damage, far_runs = over_ssh
    reference = shared("preempt-ddp-reference", lambda: ddp_reference(env, jobs))
    name = job_name("mc", "ssh")
    run_dir = Path(env["LMLAUNCH_RUNS_ROOT"]) / name
    out = _dry_run_with_here_held(env, name, "[here, viassh]")
    assert "#   viassh: starts " in out and "# chosen: viassh (it starts soonest)" in out, out[:1500]  # asked over ssh

    damage.write_text("")  # the first copy there arrives damaged
    first, run_dir = submit(env, name, "clusters=[here, viassh]", MOVE, holds=(held_at(16),))  # until preempted
    jobs.append(first)
    wait_held(run_dir, 16)
    code, out, err = lm(env, "preempt", name, "--mode", "requeue")
    assert code == 0, out + err
    waiting.until(lambda: any(e.get("event") == "move_abandoned" for e in ledger(run_dir)),
                  progress=lambda: len(ledger(run_dir)), what="the damaged copy refused",
                  explain=lambda: _mover_log(run_dir))
    code, out, err = lm(env, "status", name, "--json")
    row = json.loads(out)["runs"][0]
    assert row["job_id"] == first and row["state"] == "PENDING", row
    assert "a move to viassh was abandoned (the copy of checkpoint step-" in row["note"], row
    assert "does not match its checksums (meta.json: xxh3_128" in row["note"] and "it waits on here still" in row["note"]
    damage.unlink()  # the next copy arrives whole: moved, and trained there to the end
    _wait_done(run_dir, f"run {name} moved over ssh and done")

    moved = [e for e in ledger(run_dir) if e.get("event") == "moved"]
    assert len(moved) == 1 and (moved[0]["from"], moved[0]["from_job"], moved[0]["to"]) == ("here", first, "viassh")
    second = moved[0]["to_job"]
    assert [(s["job_id"], s.get("profile")) for s in starts(run_dir)] == [(first, "here"), (second, "there")]
    assert [e["reason"] for e in ends(run_dir)] == ["preempted", "completed"]
    assert_losses_match(run_dir, reference["losses"])
    assert_weights_identical(run_dir, reference)  # the final checkpoint, copied back and checked here
    assert (far_runs / name / "DONE").exists() and not (far_runs / name / "mover.lock").exists()
    assert not [j for j in slurm.squeue([first]) if j.job_id == first and slurm.is_active(j.state)]
    code, out, err = lm(env, "history", name, "--json")
    h = json.loads(out)
    assert [(r["job_id"], r["cluster"]) for r in h["attempts"]] == [(first, "here"), (second, "viassh")], h["attempts"]
    assert any("was abandoned" in n for n in h["notes"]) and any("to viassh (job" in n for n in h["notes"]), h["notes"]
    code, out, err = lm(env, "status", "--json")
    row = next(r for r in json.loads(out)["runs"] if r["name"] == name)
    assert (row["job_id"], row["cluster"]) == (second, "viassh") and row["state"] in ("COMPLETED", "RUNNING"), row


def test_a_run_whose_checkpoints_are_in_one_bucket_moves_over_ssh_copying_none(over_ssh, jobs):
    """Both clusters' profiles name the local cluster's S3 gateway: preempted on the first, the stop
    checkpoint is uploaded (the end line says so), the move copies only the run directory (the bucket
    holds the newest checkpoint, said in the ledger), the attempt there downloads it and the run ends
    bit-identical to the uninterrupted one."""
    import uuid

    from launcher.localcluster import object_store
    from lmcore.objects.credentials import s3_client
    from tests import gateway

    env, _, far_runs = over_ssh
    reference = shared("preempt-ddp-reference", lambda: ddp_reference(env, jobs))
    name = job_name("mc", "bucket")
    with gateway.shared():
        creds = object_store.up(lambda line: None)
        client, bucket = s3_client(creds), f"mc-{uuid.uuid4().hex[:12]}"
        client.create_bucket(Bucket=bucket)
        line = f"object_store_credentials: {object_store.store_layout().credentials}\n"
        for profile in (Path(env["LMLAUNCH_HOME"]) / "profiles" / "here.yaml", far_runs.parent / "far-home" / "profiles"
                        / "there.yaml", Path(env["LMLAUNCH_HOME"]) / "profiles" / "viassh.yaml"):
            if line not in profile.read_text():
                profile.write_text(profile.read_text() + line)
        try:
            store = f"s3://{bucket}/runs/{name}"
            first, run_dir = submit(env, name, "clusters=[here, viassh]", MOVE, f"checkpoint.dir={store}",
                                    holds=(held_at(16),))
            jobs.append(first)
            wait_held(run_dir, 16)
            code, out, err = lm(env, "preempt", name, "--mode", "requeue")
            assert code == 0, out + err
            _wait_done(run_dir, f"run {name} moved over ssh through its bucket and done")
        finally:
            object_store.remove_bucket(client, bucket)
    stop = ends(run_dir)[0]
    assert stop["reason"] == "preempted" and stop["bucket"] == {"step": stop["end_step"], "store": store,
                                                                 "uploaded": True}, stop
    moved = [e for e in ledger(run_dir) if e.get("event") == "moved"]
    assert len(moved) == 1 and (moved[0]["from_job"], moved[0]["to"]) == (first, "viassh"), moved
    assert moved[0]["checkpoint"] == (f"checkpoint step-{stop['end_step']} is in {store}, which both clusters "
                                      "read: not copied"), moved
    assert "checked there" not in _mover_log(run_dir)  # no checkpoint went over ssh
    far_log = "".join(p.read_text(errors="replace") for p in (far_runs / name / "submitit").glob("*_log.*"))
    assert f"checkpoint step-{stop['end_step']}: downloaded from {store}" in far_log, far_log[-3000:]
    assert [e["reason"] for e in ends(run_dir)] == ["preempted", "completed"]
    assert starts(run_dir)[1]["start_step"] == stop["end_step"]
    assert_losses_match(run_dir, reference["losses"])
    assert_weights_identical(run_dir, reference)
    code, out, err = lm(env, "history", name, "--json")
    assert any("which both clusters read: not copied" in n for n in json.loads(out)["notes"]), out


def test_a_search_places_each_trial_where_it_starts_soonest(two, jobs, tmp_path):
    """Each trial takes both nodes of a cluster whole (4 CPUs each): the first goes to the first named, the
    second to the other (the first fills the first); one max_parallel across them, one study."""
    env, _ = two
    name = job_name("mc", "search")
    here = Path(env["LMLAUNCH_HOME"]) / "profiles" / "here.yaml"
    if "sweep_storage:" not in here.read_text():
        here.write_text(here.read_text() + "sweep_storage: {local_cluster: true}\n")  # the study: one, the first's
    search = tmp_path / "search.yaml"
    search.write_text(json.dumps({"name": name, "search": "optuna", "trials": 2, "max_parallel": 2,
                                  "objective": {"metric": "loss", "at": "last"}, "pruner": {"name": "none"},
                                  "params": {"optim.lr": {"float": [1.0e-3, 1.0e-2], "log": True}}}))
    args = (SPEC, search, *BASE, "trainer.max_steps=10", "resources.cpus_per_task=4", "clusters=[here, there]")
    code, out, err = lm(env, "sweep", *args, "--dry-run")
    assert code == 0 and "clusters:  here, there: each trial goes where it starts soonest" in out, out + err
    code, out, err = lm(env, "sweep", *args)
    assert code == 0, out + err
    placed = dict(re.findall(rf"trial (\d) \({re.escape(name)}\.\d\): job \d+ on (\w+):", out))
    assert placed == {"0": "here", "1": "there"}, out
    assert f"search '{name}' done: 2 trials (2 complete)" in out, out
    code, out, err = lm(env, "status", name, "--json")
    rows = json.loads(out)["runs"]
    assert sorted((r["name"], r["cluster"]) for r in rows) == [(f"{name}.0", "here"), (f"{name}.1", "there")], rows
    jobs.extend(r["job_id"] for r in rows if r["cluster"] == "here")
