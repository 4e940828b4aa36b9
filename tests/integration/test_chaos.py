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

import os
import secrets

import chaos_campaign
import chaos_schedule
import chaos_verdict
import pytest
from preempt_helpers import EVERY, MAX_STEPS, PACE_S, ddp_reference
from shared_results import shared
from slurm_helpers import job_name, own_worker_cluster

from launcher.localcluster import cluster

FAULTS = 4
# A rank killed and a node failed in every campaign (the restart in place and the spare, the paths the
# single-fault tests of those took before); the rest drawn from the catalogue by weight.
MUST = ("rank_kill", "node_down")
# The catalogue but for the batch script's node failing: with spare nodes (sbatch --no-kill) SLURM ends
# the job FAILED, never requeued, and no rank is left that requeues it (found by the campaign, seed 7;
# docs/chaos.md, "What the campaigns found"). It stays out of the suite's draw until that is fixed.
KINDS = {k: v for k, v in chaos_schedule.KINDS.items() if k != "batch_host_down"}


@pytest.fixture(scope="module")
def reference(slurm_cluster, module_env, module_jobs):
    return shared("preempt-ddp-reference", lambda: ddp_reference(module_env, module_jobs))


def test_a_short_chaos_campaign_with_a_fresh_seed_ends_bit_identical_and_leaves_nothing_behind(
        reference, module_env, capsys):
    seed = int(os.environ.get("LMLAUNCH_CHAOS_SEED") or secrets.randbelow(2**31))
    schedule = chaos_schedule.draw(seed, faults=FAULTS, max_steps=MAX_STEPS, every=EVERY, must=MUST, kinds=KINDS)
    said: list[str] = []
    with capsys.disabled():
        print(f"\nchaos campaign: seed {seed} (LMLAUNCH_CHAOS_SEED={seed} draws it again)", flush=True)
        for f in schedule.faults:
            print("  " + f.label(), flush=True)
    name = job_name("pr", "chaos")
    with own_worker_cluster(name, nodes=3) as claim, cluster.own_conf(claim.layout):
        env = {**module_env, **claim.environ()}
        campaign = chaos_campaign.run(schedule, env, claim.layout, claim.ports, name, pace_s=PACE_S, say=said.append)
        verdict = chaos_verdict.judge(campaign, reference, env, keep_last=2)
    assert verdict.ok, "\n".join([*said, verdict.table(), "schedule:", schedule.to_json()])
    landed = [r for r in verdict.rows if r.landed]
    assert landed, verdict.table()  # a campaign whose faults all missed proves nothing
