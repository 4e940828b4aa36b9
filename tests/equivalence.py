"""The equivalence matrix: the same model trained on the same data by every way to scale that
lmlaunch offers on CPU, each compared with DDP step by step (loss, gradient norm) and by its final
weights, read as ``export`` reads them (gathered from whatever the strategy wrote).

Every run goes through the real entry (``prepare_local_run`` then ``lmtrain.local.launch``: the
planner, Lightning, lmtrain's strategy, sampler, module, clipping and checkpoints), with the shipped
specs' settings: gradient clipping at 1.0 (hit: the unclipped norm exceeds it in the compared steps),
gradient accumulation 2 on DDP's 2 ranks (global batch 8 of micro batches of 2), weight decay 0.1,
warmup then cosine, dropout off (so that every layout computes the same function).

Used by tests/unit/test_equivalence_matrix.py (every strategy, a tied and an untied model) and by
bench/equivalence.py (the slow cells: more architectures, bf16 autocast), which prints the table.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
HELPER = REPO / "tests" / "unit" / "_train_with_stop.py"
STEPS = 8
CLIP = 1.0
TOKENS = {"vocab_size": 260, "pad_token_id": 256, "bos_token_id": 256, "eos_token_id": 256}
NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "hidden_dropout": 0.0,
              "attention_dropout": 0.0, "dropout": 0.0, "activation_dropout": 0.0}
# 4 blocks (the interleaved schedules put 2 stages on each of 2 ranks), width 32, 4 heads.
MODELS: dict[str, dict[str, Any]] = {
    "gpt2": {"n_layer": 4, "n_embd": 32, "n_head": 4, "n_positions": 64,
             **{k: 0.0 for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}},  # tied head
    "llama": {"num_hidden_layers": 4, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 64, "tie_word_embeddings": False},
    "qwen2": {"num_hidden_layers": 4, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 64, "tie_word_embeddings": True},
    "gpt_neox": {"num_hidden_layers": 4, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                 "max_position_embeddings": 64, "hidden_dropout": 0.0, "attention_dropout": 0.0},
    "opt": {"num_hidden_layers": 4, "hidden_size": 32, "ffn_dim": 64, "num_attention_heads": 4,
            "max_position_embeddings": 64, "word_embed_proj_dim": 32, "dropout": 0.0,
            "attention_dropout": 0.0, "activation_dropout": 0.0},  # tied head, learned positions
}
# any other type (bench/equivalence.py --models): the sizes most decoder-only types name this way
LLAMA_LIKE = {**MODELS["llama"], "head_dim": 8}

COMMON = ["data.seq_len=32", "data.micro_batch_size=2", "trainer.global_batch_size=8", "trainer.log_every_n_steps=1",
          f"trainer.val_check_interval={STEPS}", "trainer.limit_val_batches=1", f"checkpoint.every_n_steps={STEPS}",
          "checkpoint.keep_last=1", "optim.warmup_steps=3", "optim.schedule=cosine", "optim.weight_decay=0.1",
          "optim.lr=1.0e-2", "optim.min_lr=1.0e-3", f"trainer.gradient_clip_val={CLIP}", "logging.tensorboard=false"]
FSDP = ["trainer.strategy=fsdp"]


def _pp(schedule: str, *extra: str) -> list[str]:
    return [*FSDP, "trainer.pipeline_parallel_size=2", f"trainer.pipeline_schedule={schedule}", *extra]


def _tp(*extra: str) -> list[str]:
    return [*FSDP, "trainer.tensor_parallel_size=2", *extra]


# layout -> (local ranks, overrides)
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "ddp": (2, ["trainer.strategy=ddp"]),
    "fsdp2": (2, FSDP),
    "zero1": (2, ["trainer.strategy=deepspeed", "trainer.zero_stage=1"]),
    "zero2": (2, ["trainer.strategy=deepspeed", "trainer.zero_stage=2"]),
    "zero3": (2, ["trainer.strategy=deepspeed", "trainer.zero_stage=3"]),
    "tp2": (2, _tp("trainer.sequence_parallel=false")),
    "tp2+sp": (2, _tp("trainer.sequence_parallel=true")),
    "pp2-gpipe": (2, _pp("gpipe")),
    "pp2-1f1b": (2, _pp("1f1b")),
    "pp2-interleaved": (2, _pp("interleaved_1f1b")),
    "pp2-zero-bubble": (2, _pp("interleaved_zero_bubble")),
    "fsdp2xtp2": (4, _tp("trainer.sequence_parallel=true")),
    "tp2xpp2": (4, _pp("1f1b", "trainer.tensor_parallel_size=2", "trainer.sequence_parallel=false")),
    "fsdp2xpp2": (4, _pp("1f1b")),
}  # dp2 x tp2 x pp2 needs 8 ranks, beyond the local profile's 4 a node: tp2xpp2 is 3D's dp1 form


def spec_file(model: str, where: Path) -> Path:
    """jobs/tiny-cpu.yaml with ``model``'s tiny config (dropout off) and the repository's data."""
    spec = yaml.safe_load((REPO / "jobs" / "tiny-cpu.yaml").read_text())
    spec["model"] = {"type": model, "config": {**MODELS.get(model, LLAMA_LIKE), **TOKENS}}
    spec["data"]["path"] = str(REPO / "data" / "prepared" / "tiny")
    path = where / f"equivalence-{model}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@dataclasses.dataclass
class Trained:
    """One cell's run: (loss, gradient norm) per optimizer step and the final weights as export reads them."""
    layout: str
    run_dir: str
    steps: dict[int, tuple[float, float]]
    weights: dict[str, Any]


def plan(model: str, layout: str, where: Path, precision: str = "32-true", *, name: str | None = None,
         resume: bool = False, max_steps: int = STEPS) -> Any:
    """The local run's plan of ``model`` with ``layout`` (specs written under ``where``; runs root:
    the environment's LMLAUNCH_RUNS_ROOT); SpecError or UserError when the planner refuses it."""
    from launcher.submit.local_run import prepare_local_run

    devices, overrides = LAYOUTS[layout]
    name = name or f"equivalence-{model}-{layout}-{precision}".replace("+", "-")
    return prepare_local_run(str(spec_file(model, where)), [*COMMON, *overrides, f"trainer.precision={precision}"],
                             devices=devices, max_steps=max_steps, name=name, environ=dict(os.environ),
                             say=lambda *_: None, resume=resume)


def train(model: str, layout: str, where: Path, precision: str = "32-true", *, name: str | None = None,
          stop_at: int = 0, resume: bool = False, max_steps: int = STEPS) -> Trained | str:
    """Train ``model`` with ``layout`` to ``max_steps`` through the real entry (stopped as a preemption
    stops it at ``stop_at``; ``resume``: from the run's newest checkpoint); what the planner says when
    it refuses the layout for this model (a str: GPT-2 has no tensor-parallel plan)."""
    from lmcore.errors import SpecError
    from lmtrain.checkpoint.manager import complete_checkpoints
    from lmtrain.checkpoint.weights import model_state_dict
    from lmtrain.local.launch import launch

    try:
        planned = plan(model, layout, where, precision, name=name, resume=resume, max_steps=max_steps)
    except SpecError as exc:
        return "; ".join(exc.problems)
    run_dir = planned.paths.run_dir
    with open(Path(run_dir) / "launcher.out", "a") as out:
        code = launch(run_dir, planned.topology.world_size, plan_env=planned.env, threads_per_proc=1,
                      command=[sys.executable, "-u", str(HELPER), run_dir, str(stop_at)], out=out)
    if code != 0:
        raise RuntimeError(f"{model} {layout}: exit {code}\n" + Path(run_dir, "launcher.out").read_text()[-3000:])
    last = complete_checkpoints(Path(run_dir) / "checkpoints")[-1]
    return Trained(layout, run_dir, _steps(run_dir), model_state_dict(last.path))


def _steps(run_dir: str) -> dict[int, tuple[float, float]]:
    import json

    out = {}
    for line in Path(run_dir, "metrics", "heartbeat.jsonl").read_text().splitlines():
        d = json.loads(line)
        if d["event"] == "step":
            out[d["step"]] = (d["loss"], d["grad_norm"])
    return out


def initial_weights(model: str, where: Path) -> dict[str, Any]:
    """The weights every layout starts from: ``model`` built from its spec with the spec's seed, as
    each rank builds it (the measure of how far training moved them)."""
    from launcher.spec.jobfile import load_job
    from lmtrain.model.causal_lm import build_model

    job = load_job(spec_file(model, where))
    return build_model(job.model, seed=job.trainer.seed).state_dict()


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """How far a layout may be from DDP: the loss and the gradient norm of every step (relative),
    the final weights (the largest difference of any element) and the update (the whole difference
    from DDP's weights against how far DDP moved them from the initial weights, both L2 norms)."""
    loss: float
    norm: float
    weight: float
    update: float


# fp32: the layouts differ only in the order of float reductions (all-reduce against reduce-scatter,
# a sum over stages or shards): measured up to 1.2e-7 of the loss and 5.4e-7 of the norm over 8 steps
# (5 architectures). The weights differ more than the loss: AdamW moves an element whose gradient is
# tiny by about the learning rate whatever its size (m / sqrt(v) ~ its sign), so reordering noise in
# such a gradient can move it by up to lr (1e-2) a step; measured up to 1.4e-5 (9.2e-5 on OLMo-2 under
# ZeRO-3, below); allowed 1 % of a step.
# The next steps' gradients then differ by what those elements moved: OLMo-2 (norms after attention
# and MLP, on the queries and keys) under ZeRO-3 had step 1's norm equal to 5e-8, then 6.5e-6, 9.5e-6,
# 2.4e-5 at step 4 and back to 8e-7 by step 8, every loss within 3.4e-7 (the held-out bench); allowed
# 1e-4 of the norm. A defect shows in the loss first (the clipping of a tied head on pipeline stages
# was 1.3e-4 of it by step 3).
# bf16-mixed: DDP, TP and the pipelines' plain stages autocast over fp32 parameters; FSDP2 and
# DeepSpeed compute with bf16 copies of the parameters (FSDP2's MixedPrecisionPolicy, DeepSpeed's bf16
# weights over fp32 masters), so their norm layers and embeddings are rounded to 8 bits of mantissa:
# measured up to 7.9e-3 of the loss and 4.4e-2 on a weight against DDP, and a step whose gradient
# norm is up to 2.9x DDP's where the loss falls fastest (ZeRO-1, unsharded, shows it too: the
# precision, not the sharding). Any single weight is then the wrong judge: AdamW's near-sign update
# of a tiny gradient flips with the rounding, so an element may differ by up to 2 lr a step (measured
# 6.5e-2 on GPT-NeoX and OPT under FSDP2 and ZeRO). The update as a whole is what training decides:
# the weights' L2 distance from DDP's against DDP's own distance from the initial weights, measured
# up to 0.10 (Llama under FSDP2 and ZeRO-1; 4.5e-2 GPT-NeoX) in bf16 and 7.2e-6 in fp32 (6.6e-5 OLMo-2
# under ZeRO-3); allowed 0.2 in bf16, 1e-4 in fp32. The bf16 cells are therefore the coarse check (a
# wrong function or a lost gradient), not the check of a setting: DDP in bf16 clipped at 0.8 instead of 1.0 moved 5e-5 of the loss and 2.7e-3
# of the update, weight decay 0.05 instead of 0.1 3.3e-4 and 4.2e-3, both far inside bf16's own noise
# and far outside fp32's tolerance (the fine check, every strategy in the suite). The norm and the
# single weight are reported, not judged, in bf16.
TOLERANCES = {"32-true": Tolerance(loss=1e-6, norm=1e-4, weight=1e-4, update=1e-4),
              "bf16-mixed": Tolerance(loss=1e-2, norm=float("inf"), weight=float("inf"), update=0.2)}


@dataclasses.dataclass
class Row:
    """One cell of the table: a layout's largest differences from DDP (None: refused, ``said``)."""
    model: str
    layout: str
    precision: str
    loss: float | None = None
    norm: float | None = None
    weight: float | None = None
    update: float | None = None  # None also where no initial weights were given (not judged)
    clipped: int = 0  # steps whose (DDP) norm exceeded the clip: clipping decided them
    said: str = ""

    def ok(self) -> bool:
        if self.loss is None or self.norm is None or self.weight is None:
            return False
        tol = TOLERANCES[self.precision]
        update_ok = self.update is None or self.update <= tol.update
        return self.loss <= tol.loss and self.norm <= tol.norm and self.weight <= tol.weight and update_ok


def compare(model: str, layout: str, ref: Trained, got: Trained | str, precision: str = "32-true",
            initial: dict[str, Any] | None = None) -> Row:
    """``got`` against DDP's ``ref``, step by step and weight by weight (a tied head stored once
    by a sharded strategy is compared as its embedding); with the ``initial`` weights, the update too."""
    if isinstance(got, str):
        return Row(model, layout, precision, said=got)
    row = Row(model, layout, precision, clipped=sum(norm > CLIP for _, norm in ref.steps.values()))
    if sorted(got.steps) != sorted(ref.steps):
        row.said = f"steps {sorted(got.steps)} logged, DDP logged {sorted(ref.steps)}"
        return row
    row.loss = max(abs(got.steps[s][0] - ref.steps[s][0]) / abs(ref.steps[s][0]) for s in ref.steps)
    row.norm = max(abs(got.steps[s][1] - ref.steps[s][1]) / abs(ref.steps[s][1]) for s in ref.steps)
    missing = sorted(set(ref.weights) - set(got.weights) - {"lm_head.weight"})
    if missing or set(got.weights) - set(ref.weights):
        row.said = f"weights named otherwise: {missing[:3]} missing, {sorted(set(got.weights) - set(ref.weights))[:3]} more"
        row.weight = None
        return row
    row.weight = max(float((got.weights[k] - ref.weights[k]).detach().abs().max()) for k in got.weights)
    if initial is not None:
        apart = sum(float((got.weights[k].float() - ref.weights[k].float()).square().sum()) for k in got.weights)
        moved = sum(float((ref.weights[k].float() - initial[k].float()).square().sum()) for k in got.weights)
        row.update = (apart / moved) ** 0.5
    return row


def table(rows: list[Row]) -> str:
    """The matrix as a markdown table: each layout's largest differences from DDP."""
    lines = ["| model | layout | precision | loss (rel) | grad norm (rel) | weights (abs) | update (rel) | clipped steps | |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        figures = " | ".join("-" if v is None else f"{v:.1e}" for v in (r.loss, r.norm, r.weight, r.update))
        verdict = "ok" if r.ok() else (r.said[:100] or "OFF")
        lines.append(f"| {r.model} | {r.layout} | {r.precision} | {figures} | {r.clipped}/{STEPS} | {verdict} |")
    return "\n".join(lines)
