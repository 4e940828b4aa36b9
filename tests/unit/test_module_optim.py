"""Learning-rate schedule values, AdamW weight-decay groups, and the FLOPs-per-token formula."""

from __future__ import annotations

import math

import pytest
import torch

from lmtrain.model.causal_lm import build_model, model_shape
from lmtrain.model.module import OptimSettings, lr_at, param_groups


def _s(schedule: str, warmup: int = 10, max_steps: int = 110) -> OptimSettings:
    return OptimSettings(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, warmup_steps=warmup,
                         schedule=schedule, min_lr=1e-4, max_steps=max_steps)


def test_warmup_is_linear_to_peak_lr():
    s = _s("cosine")
    assert [lr_at(i, s) for i in (0, 4, 9)] == pytest.approx([1e-4, 5e-4, 1e-3])


@pytest.mark.parametrize(
    "schedule,mid,end",
    [("cosine", 1e-4 + 0.5 * 9e-4, 1e-4), ("linear", 1e-3 - 0.5 * 9e-4, 1e-4), ("constant", 1e-3, 1e-3)],
)
def test_decay_after_warmup_reaches_min_lr_at_max_steps(schedule, mid, end):
    s = _s(schedule)
    assert lr_at(10, s) == pytest.approx(1e-3)
    assert lr_at(60, s) == pytest.approx(mid)  # halfway through the 100 decay steps
    assert lr_at(110, s) == pytest.approx(end)
    assert lr_at(500, s) == pytest.approx(end)  # never below min_lr past max_steps


def test_cosine_quarter_point():
    s = _s("cosine", warmup=0, max_steps=100)
    assert lr_at(25, s) == pytest.approx(1e-4 + 0.5 * 9e-4 * (1 + math.cos(math.pi / 4)))


def test_lambda_scheduler_steps_through_the_same_values():
    s = _s("cosine")
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=s.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: lr_at(i, s) / s.lr)
    seen = []
    for _ in range(20):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([lr_at(i, s) for i in range(20)])


GPT2_TINY = {"type": "gpt2", "config": {"n_layer": 2, "n_head": 2, "n_embd": 16, "n_positions": 32, "vocab_size": 64}}


def test_weight_decay_only_on_matrices_and_embeddings_not_biases_or_norms():
    model = build_model(GPT2_TINY, seed=0)
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    not_decayed = {names[id(p)] for p in no_decay["params"]}
    assert "transformer.wte.weight" in decayed and "transformer.h.0.attn.c_attn.weight" in decayed
    assert "transformer.h.0.ln_1.weight" in not_decayed and "transformer.h.0.attn.c_attn.bias" in not_decayed
    assert "transformer.ln_f.bias" in not_decayed
    assert all(p.ndim >= 2 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    # every parameter exactly once (lm_head is tied to wte)
    assert len(decayed) + len(not_decayed) == len({id(p) for p in model.parameters()})


def test_flops_per_token_counts_matmuls_and_attention_not_position_embeddings():
    model = build_model(GPT2_TINY, seed=0)
    shape = model_shape(model)
    d, L, V = 16, 2, 64
    per_layer = 3 * d * d + d * d + 4 * d * d + 4 * d * d  # c_attn, c_proj, c_fc, mlp c_proj
    assert shape.matmul_params == L * per_layer + V * d  # + tied wte as the output head
    assert shape.flops_per_token(32) == 6 * shape.matmul_params + 12 * L * d * 32


def test_llama_model_from_type_and_overrides_uses_sdpa():
    spec = {"type": "llama", "config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}}
    model = build_model(spec, seed=1)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config._attn_implementation == "sdpa"
    again = build_model(spec, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
