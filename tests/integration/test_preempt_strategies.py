"""Sharded strategies on the real 2-node local cluster (CPU, gloo): a job of FSDP2, ZeRO-2 and
ZeRO-3, 2D (FSDP2 x tensor parallelism with sequence parallelism, 2 nodes x 2 tasks) and a pipeline
(2 stages, one per node, 1F1B) is really
preempted by a high-priority exclusive job at a random step, requeued, and resumes from its sharded
checkpoint; its per-step losses and final weights equal an uninterrupted
run of the same strategy, bit for bit. (DDP: test_preempt_resume.py; ZeRO-1 shares ZeRO-2's
checkpoint code and is stopped and resumed on real ranks in tests/unit/test_checkpoint_resume.py
and test_elastic_resume.py.) A cancelled run resumed with other resources continues on 4 ranks
(ZeRO-2) and on 1 (FSDP2). One uninterrupted run per strategy (shared by the workers) is the
reference of both.

The final weights are read with lmtrain.checkpoint.weights (DCP shards and ZeRO partitions assembled on
one CPU process), which is also what `lmlaunch export` uses.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import torch
from preempt_helpers import (
    BASE,
    SPEC,
    assert_losses_match,
    ends,
    finish,
    held_at,
    lm,
    losses_by_step,
    preempt,
    starts,
    submit,
    wait_ended,
    wait_held,
)
from shared_results import shared
from slurm_helpers import job_name

from lmtrain.checkpoint.manager import complete_checkpoints
from lmtrain.checkpoint.weights import lightning_state_dict

STRATEGIES = {
    "fsdp": ("trainer.strategy=fsdp",),
    "zero2": ("trainer.strategy=deepspeed", "trainer.zero_stage=2"),
    "zero3": ("trainer.strategy=deepspeed", "trainer.zero_stage=3"),
    # 2D: a tiny Llama split over the 2 ranks of each node (sequence parallel), FSDP2 across the nodes
    "tp": ("trainer.strategy=fsdp", "trainer.tensor_parallel_size=2", "trainer.sequence_parallel=true",
           "resources.tasks_per_node=2", "model.type=llama",
           "model.config={num_hidden_layers: 2, hidden_size: 32, intermediate_size: 64, num_attention_heads: 4, "
           "num_key_value_heads: 2, max_position_embeddings: 128, vocab_size: 260, bos_token_id: 256, "
           "eos_token_id: 256, tie_word_embeddings: true}", "data.seq_len=64"),  # 4 ranks on 2 cores: small
    # pipeline: the tiny Llama's 4 blocks in 2 stages, one per node (1F1B, 4 microbatches of 4 per step)
    "pp": ("trainer.strategy=fsdp", "trainer.pipeline_parallel_size=2", "model.type=llama",
           "model.config={num_hidden_layers: 4, hidden_size: 32, intermediate_size: 64, num_attention_heads: 4, "
           "num_key_value_heads: 2, max_position_embeddings: 128, vocab_size: 260, bos_token_id: 256, "
           "eos_token_id: 256, tie_word_embeddings: false}", "data.seq_len=64"),
}
# The shard files each strategy writes per rank inside lightning.ckpt (every rank writes its own).
SHARDS = {
    "fsdp": ["__0_0.distcp", "__1_0.distcp"],
    "zero2": ["checkpoint/zero_pp_rank_0_mp_rank_00_optim_states.pt", "checkpoint/zero_pp_rank_1_mp_rank_00_optim_states.pt"],
    "zero3": ["checkpoint/zero_pp_rank_0_mp_rank_00_optim_states.pt", "checkpoint/zero_pp_rank_1_mp_rank_00_optim_states.pt"],
    "tp": [f"__{r}_0.distcp" for r in range(4)],
    "pp": ["__0_0.distcp", "__1_0.distcp"],  # each stage its own blocks
}


@pytest.fixture(scope="module")
def env(module_env):
    return module_env  # one registry and runs root for the module (conftest)


@pytest.fixture(scope="module")
def jobs(module_jobs):
    return module_jobs


def _final(run_dir: Path) -> tuple[int, dict[str, torch.Tensor]]:
    last = complete_checkpoints(run_dir / "checkpoints")[-1]
    return last.step, lightning_state_dict(last.path)


# Half the DDP tests' steps (preempt_helpers.MAX_STEPS): a sharded step costs several DDP ones on
# CPU (ZeRO-3, 4 ranks of 2D on 2 cores), and 40 steps still hold 4 periodic checkpoints, a
# preemption between two of them and a cancel at step 25.
MAX_STEPS = 40
STEPS = (f"trainer.max_steps={MAX_STEPS}",)  # after BASE's: the later override wins
NO_DROPOUT = ("model.config.resid_pdrop=0.0", "model.config.embd_pdrop=0.0", "model.config.attn_pdrop=0.0")
# every run here: dropout off (the elastic runs compare losses across world sizes) and micro batch 4
# (accumulation 2 on 2 ranks, 1 on 4)
COMMON = (*NO_DROPOUT, "data.micro_batch_size=4", *STEPS)
LLAMA_COMMON = ("data.micro_batch_size=4", *STEPS)  # llama's config has no GPT-2 dropout keys (its attention_dropout is 0)


def _common(strategy: str) -> tuple[str, ...]:
    return LLAMA_COMMON if strategy in ("tp", "pp") else COMMON


def _reference(strategy: str, env, jobs) -> dict:
    """The uninterrupted 2-rank run of ``strategy``: per-step losses and final weights, made once per
    test run for every worker (tests/shared_results.py)."""
    def run() -> dict:
        ref_name = job_name("pr", f"ref-{strategy}")
        job, ref_dir = submit(env, ref_name, *STRATEGIES[strategy], *_common(strategy), pace_s=None)  # nothing acts on it
        jobs.append(job)
        finish(job, ref_dir)
        assert [e["reason"] for e in ends(ref_dir)] == ["completed"]
        losses = {s: v[0] for s, v in losses_by_step(ref_dir).items()}
        assert sorted(losses) == list(range(1, MAX_STEPS + 1))
        ckpt = complete_checkpoints(ref_dir / "checkpoints")[-1]
        for shard in SHARDS[strategy]:  # sharded: each rank wrote its own files
            assert (ckpt.lightning_path / shard).is_file(), sorted(p.name for p in ckpt.lightning_path.rglob("*"))
        step, weights = _final(ref_dir)
        return {"losses": losses, "step": step, "weights": weights}

    return shared(f"preempt-strategy-reference-{strategy}", run)


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_sharded_strategy_preempted_and_resumed_equals_uninterrupted(strategy, slurm_cluster, env, jobs):
    overrides = (*STRATEGIES[strategy], *_common(strategy))
    ref = _reference(strategy, env, jobs)
    reference, ref_step, ref_weights = ref["losses"], ref["step"], ref["weights"]

    name = job_name("pr", f"pre-{strategy}")
    at = random.randint(5, MAX_STEPS - 15)  # held there until the preemption's signal
    job, run_dir = submit(env, name, *overrides, holds=(held_at(at),), pace_s=None)
    jobs.append(job)
    seen = wait_held(run_dir, at)
    r = preempt(env, name, "requeue", "--start-now")
    assert r["requeued"], r
    finish(job, run_dir)

    first, second = ends(run_dir)[0], starts(run_dir)[1]
    assert first["reason"] == "preempted", first
    assert seen <= first["end_step"] == at, (seen, at, first)
    assert second["start_step"] == first["end_step"], (first, second)  # the stop checkpoint, 0 steps lost
    assert ends(run_dir)[-1]["reason"] == "completed" and ends(run_dir)[-1]["end_step"] == MAX_STEPS
    assert_losses_match(run_dir, reference)
    step, weights = _final(run_dir)
    assert step == ref_step == MAX_STEPS
    assert weights.keys() == ref_weights.keys()
    differ = [k for k in weights if not torch.equal(weights[k], ref_weights[k])]
    assert not differ, f"{strategy}: final weights differ from the uninterrupted run in {differ}"


ELASTIC = {
    # strategy, resources of the second job: 2 ranks -> 4 (2 nodes x 2 tasks) or -> 1 (1 node x 1 task)
    "zero2-2to4": ("zero2", ("resources.tasks_per_node=2",), 4),  # micro batch 4: accumulation 2 -> 1
    "fsdp-2to1": ("fsdp", ("resources.nodes=1",), 1),
}


@pytest.mark.parametrize("case", sorted(ELASTIC))
def test_a_cancelled_run_resumed_with_other_resources_continues_on_the_new_world_size(case, slurm_cluster, env, jobs):
    """Submit on 2 ranks, cancel, `submit --resume` with other resources: the job starts on the new
    world size from the cancel's checkpoint (ZeRO via the universal checkpoint, FSDP via DCP
    resharding) and its losses follow an uninterrupted 2-rank run (tolerance: see
    tests/unit/test_elastic_resume.py; dropout off)."""
    strategy, resources, world = ELASTIC[case]
    overrides = (*STRATEGIES[strategy], *COMMON)
    reference = _reference(strategy, env, jobs)["losses"]

    name = job_name("pr", f"el-{case}")
    job, run_dir = submit(env, name, *overrides, holds=(held_at(25),), pace_s=None)  # held there until the cancel's SIGTERM
    jobs.append(job)
    wait_held(run_dir, 25)
    code, out, err = lm(env, "cancel", name)
    assert code == 0, out + err
    wait_ended(job)
    stop = ends(run_dir)[0]
    assert stop["reason"] == "cancelled", stop

    code, out, err = lm(env, "submit", SPEC, f"name={name}", *BASE, *overrides, *resources, "--resume")
    assert code == 0, out + err
    assert f"on {world} ranks" in out, out  # the resume note says how it reshards
    job2 = re.search(r"job (\d+)", out).group(1)
    jobs.append(job2)
    finish(job2, run_dir)
    second = starts(run_dir)[-1]
    assert second["world_size"] == world and second["start_step"] == stop["end_step"], second
    assert ends(run_dir)[-1]["reason"] == "completed" and ends(run_dir)[-1]["end_step"] == MAX_STEPS
    got = {s: v[-1] for s, v in losses_by_step(run_dir).items()}
    assert sorted(got) == list(range(1, MAX_STEPS + 1))
    for step in range(stop["end_step"] + 1, MAX_STEPS + 1):
        assert got[step] == pytest.approx(reference[step], rel=1e-3), (step, got[step], reference[step])
