"""Whether a causal LM's pipeline stages run their parts of the model, checked when a spec is
validated (launcher.planning.model_check): "validates" means "trains" for pipeline stages.

The check builds the stages the runtime builds (lmtrain.model.pipeline: the same split, the same
stand-ins for what a later stage does not hold) and runs each stage's forward in order, each on
the activation the one before it handed on, with the model's own call signature. A model up to
``STEP_CHECK_PARAMS`` runs on the CPU (a fraction of a second) and the last stage's logits must be
the whole model's; a larger one runs on the meta device (shapes only, no memory: its experts with
transformers' data-independent kernel, masks without the packed-sequence search that reads the
device). An architecture whose stages fail is refused naming the stage and transformers' error.
Where the whole model itself does not run on the meta device (a kernel with no meta
implementation), its stages cannot be checked there: a note says so, nothing is refused.
"""

from __future__ import annotations

from typing import Any

import torch


def check_pipeline(model_spec: Any, pipeline: int, schedule: str = "1f1b") -> str | None:
    """ValueError naming ``trainer.pipeline_parallel_size`` when the model cannot be split into this
    pipeline or a stage cannot run its part; a note when the stages could not be checked here; None
    when every stage runs (and, on the CPU, the stages compute the whole model's logits)."""
    from transformers import AutoModelForCausalLM

    from lmtrain.model.causal_lm import STEP_CHECK_PARAMS, attention_for, build_config, model_settings
    from lmtrain.model.masks import never_packed
    from lmtrain.model.pipeline import problems

    never_packed()
    m = model_settings(model_spec)
    config = build_config(m)
    kwargs: dict[str, Any] = {"attn_implementation": attention_for(m, config), "dtype": torch.float32}
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config, **kwargs)
    found = problems(lm, pipeline, schedule)
    if found:
        raise ValueError(found[0])
    small = sum(p.numel() for p in lm.parameters()) <= STEP_CHECK_PARAMS
    with torch.random.fork_rng(devices=[]):  # the caller's random streams are left as they were
        if small:
            lm = AutoModelForCausalLM.from_config(config, **kwargs)
        else:  # the experts' data-independent kernel: the others select tokens by reading the device
            with torch.device("meta"):
                lm = AutoModelForCausalLM.from_config(config, **kwargs, experts_implementation="batched_mm")
        return _run_stages(lm.eval(), pipeline, schedule, "cpu" if small else "meta")


def _run_stages(lm: Any, pipeline: int, schedule: str, device: str) -> str | None:
    from lmtrain.model.pipeline import build_stages, stage_map

    kind = lm.config.model_type
    ids = torch.arange(8, device=device).unsqueeze(0) % max(2, int(getattr(lm.config, "vocab_size", 2) or 2))
    with torch.no_grad():
        try:
            whole = lm(input_ids=ids, use_cache=False).logits
        except Exception as exc:  # transformers' or torch's error, whatever its type
            return (f"trainer.pipeline_parallel_size({pipeline}): the stages of model.type {kind} were not checked "
                    f"here: the whole model does not run on the {device} device ({type(exc).__name__}: "
                    f"{str(exc)[:200]}); they are checked when the job starts")
        smap = stage_map(lm, pipeline, schedule)
        try:
            stages = sorted((s for rank in range(pipeline) for s in build_stages(lm, smap, rank)), key=lambda s: s[0])
        except Exception as exc:  # the split's own failure, whatever its type
            raise ValueError(f"trainer.pipeline_parallel_size({pipeline}): model.type {kind}'s stages cannot be built: "
                             f"{type(exc).__name__}: {str(exc)[:300]}; use trainer.pipeline_parallel_size 1") from exc
        x = ids
        for index, stage in stages:
            try:
                x = stage(x)
            except Exception as exc:  # the stage's own failure, whatever its type
                raise ValueError(
                    f"trainer.pipeline_parallel_size({pipeline}): model.type {kind} cannot run as {len(stages)} "
                    f"pipeline stages: stage {index} (layers {smap.layers[index][0]}-{smap.layers[index][1] - 1}) "
                    f"fails: {type(exc).__name__}: {str(exc)[:300]}; use trainer.pipeline_parallel_size 1"
                ) from exc
    # the same operations in the same order as the whole model: equal up to float noise (a
    # difference in what follows the head, e.g. Gemma's final soft-capping of small logits, is 1e-4
    # of them: the old 1e-4 tolerance let it through)
    if x.shape != whole.shape or (device == "cpu" and not torch.allclose(x, whole, atol=1e-6, rtol=1e-5)):
        differs = f"shape {tuple(x.shape)} against {tuple(whole.shape)}" if x.shape != whole.shape else \
            f"largest difference {float((x - whole).abs().max()):.2e}"
        raise ValueError(f"trainer.pipeline_parallel_size({pipeline}): model.type {kind}'s {len(stages)} pipeline "
                         f"stages do not compute the whole model's logits ({differs}); use "
                         "trainer.pipeline_parallel_size 1")
    return None
