"""The short chaos campaign: a few faults at seeded steps, several at once when the draw says so,
landed for real on a run on a 3-node worker cluster (2 nodes and a spare), a fresh seed each run.
The seed and the schedule are printed first; a failure replays with
``python bench/chaos.py --replay SCHEDULE.json`` (the schedule's JSON is in the failure's message)
or the same draw with ``LMLAUNCH_CHAOS_SEED=N``. The long campaign is bench/chaos.py.

The run ends COMPLETED with the per-step losses and final weights of the uninterrupted run (the
shared reference of test_preempt_resume.py), each fault shows in the ledger and in `lmlaunch history`
with how the run recovered, no attempt resumed from older than the newest usable checkpoint at the
fault, and nothing is left behind (tests/integration/chaos_verdict.py).
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

import chaos_campaign
import chaos_schedule
import chaos_verdict
import pytest
from chaos_faults import small_filesystem
from preempt_helpers import EVERY, MAX_STEPS, PACE_S, ddp_reference
from shared_results import shared
from slurm_helpers import job_name, own_worker_cluster

from launcher.localcluster import cluster

FAULTS = 5
VERSION = os.environ.get("LMLAUNCH_TEST_SLURM") or None  # the cluster's SLURM: the machine's own unless set
# A rank killed, a rank stopped and a node failed in every campaign, alone (none overlaps another
# fault), so the verdict holds them to their own paths: the rank named as SIGKILLed and the ranks
# restarted in place; the stopped rank's hang caught (by its peers' watchdogs, or its agent) and the
# ranks restarted in place; the node left out for the spare in the same job (the single-fault tests
# of the hang and of the spare are retired). The rest drawn by weight from the whole catalogue.
MUST = ("rank_kill", "rank_stop", "node_down")
KINDS = chaos_schedule.KINDS  # the whole catalogue, on every SLURM version
# Schedules a campaign failed on, each replayed as it was found once its cause was fixed
# (tests/integration/chaos_found/*.json: seed, faults; the file's "found" says what failed and the fix).
FOUND = sorted((Path(__file__).parent / "chaos_found").glob("*.json"))
# Replayed on every SLURM version the suite runs (phase 3 too): where the versions part ways. The
# batch node lost with its keeper gone: 22.05 ends the job FAILED, 24.11 and 26.05 keep it RUNNING
# with nobody in it; the run's watcher requeues it either way.
EVERY_VERSION = {"keeper-killed-then-batch-host-down"}


def _live(said: list[str], capsys):
    """A campaign's ``say``: each line live on the terminal (the CI log: a campaign that stalls raises
    before its lines could join the failure's message), and kept for that message."""
    def say(line: str) -> None:
        said.append(line)
        with capsys.disabled():
            print(line, flush=True)

    return say


@pytest.fixture(scope="module")
def reference(slurm_cluster, module_env, module_jobs):
    return shared("preempt-ddp-reference", lambda: ddp_reference(module_env, module_jobs))


def test_a_short_chaos_campaign_with_a_fresh_seed_ends_bit_identical_and_leaves_nothing_behind(
        reference, module_env, capsys, tmp_path):
    seed = int(os.environ.get("LMLAUNCH_CHAOS_SEED") or secrets.randbelow(2**31))
    schedule = chaos_schedule.draw(seed, faults=FAULTS, max_steps=MAX_STEPS, every=EVERY, must=MUST,
                                   kinds=KINDS, alone=MUST)
    said: list[str] = []
    say = _live(said, capsys)
    say(f"\nchaos campaign: seed {seed} (LMLAUNCH_CHAOS_SEED={seed} draws it again)")
    for f in schedule.faults:
        say("  " + f.label())
    name = job_name("pr", "chaos")
    with own_worker_cluster(name, nodes=3) as claim, cluster.own_conf(claim.layout):
        env = {**module_env, **claim.environ()}
        with small_filesystem(tmp_path / "checkpoints-fs", VERSION) as fs:
            campaign = chaos_campaign.run(schedule, env, claim.layout, name, pace_s=PACE_S,
                                          small_fs=fs, say=say)
            verdict = chaos_verdict.judge(campaign, reference, env, keep_last=2)
    assert verdict.ok, "\n".join([*said, verdict.table(), "schedule:", schedule.to_json()])
    landed = [r for r in verdict.rows if r.landed]
    assert landed, verdict.table()  # a campaign whose faults all missed proves nothing


@pytest.mark.parametrize("found", [pytest.param(p, id=p.stem, marks=[pytest.mark.both_versions] if p.stem in EVERY_VERSION
                                                else []) for p in FOUND])
def test_a_schedule_a_campaign_failed_on_passes_replayed(reference, module_env, found, tmp_path, capsys):
    raw = json.loads(found.read_text())
    schedule = chaos_schedule.Schedule.from_json(json.dumps(raw["schedule"]))
    said: list[str] = []
    say = _live(said, capsys)
    say(f"\nreplaying {found.name}")
    name = job_name("pr", "chaos-" + found.stem[:12])
    with own_worker_cluster(name, nodes=3) as claim, cluster.own_conf(claim.layout):
        env = {**module_env, **claim.environ()}
        with small_filesystem(tmp_path / "checkpoints-fs", VERSION) as fs:
            campaign = chaos_campaign.run(schedule, env, claim.layout, name, pace_s=PACE_S,
                                          small_fs=fs, say=say)
            verdict = chaos_verdict.judge(campaign, reference, env, keep_last=2)
    assert verdict.ok, "\n".join([raw["found"], *said, verdict.table()])
    assert all(r.landed for r in verdict.rows), verdict.table()  # the faults that found it landed again
