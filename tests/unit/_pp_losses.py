"""Test helper: per-step losses and gradient norms of tiny causal LMs trained as 2 pipeline stages
(lmtrain.model.pipeline, gloo, CPU, 2 processes) with each schedule, and as DDP over the same 2
processes on the same global batches (the reference).

usage: python _pp_losses.py OUT.json [ARCH[:SCHEDULE+...],... [SCHEDULE,... [STEPS]]] (an
architecture's own schedules after a colon, else the SCHEDULE list). Writes
{"<arch>": {"<layout>": [[loss, grad_norm], ...]}}. Each architecture keeps its own default for tied
embeddings (GPT-2, Gemma and Falcon tie the head to the input embedding); dropout is off, so that
the two layouts compute the same function.
"""

import os
import sys
import warnings

import torch
import torch.distributed as dist

from tests.unit._spawn import finish, spawn

ARCHS = ("llama", "qwen2", "mistral")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble")
STEPS, GLOBAL_BATCH, MICRO, SEQ, VOCAB, LAYERS = 20, 8, 2, 16, 101, 4


UNTIED = ("llama", "qwen2", "mistral")  # the first three, as they were first checked
NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "hidden_dropout": 0.0,
              "attention_dropout": 0.0, "classifier_dropout": 0.0, "dropout": 0.0}


def config(kind):
    from transformers import AutoConfig

    extra = {"tie_word_embeddings": False} if kind in UNTIED else {}
    if kind == "gpt2":
        extra.update(n_embd=32, n_inner=64, n_layer=LAYERS, n_head=4, n_positions=64)
    if kind == "gemma":
        extra.update(head_dim=8)
    return AutoConfig.for_model(kind, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                                num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                max_position_embeddings=64, **NO_DROPOUT, **extra)


def batch(step):
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(step))


def ddp(kind, rank, world, steps=STEPS):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        AutoModelForCausalLM.from_config(config(kind), attn_implementation="sdpa"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    per, accum, out = GLOBAL_BATCH // world, GLOBAL_BATCH // world // MICRO, []
    for step in range(steps):
        mine, total = batch(step)[rank * per:(rank + 1) * per], torch.zeros(())
        for a in range(accum):  # accumulation: micro batches of MICRO, as the pipeline's microbatches
            micro = mine[a * MICRO:(a + 1) * MICRO]
            with model.no_sync() if a < accum - 1 else _nothing():
                loss = model(input_ids=micro, labels=micro, use_cache=False).loss / accum
                loss.backward()
            total += loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        out.append([float(total) / world, float(norm)])
    return out


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *_):
        return False


def pipelined(kind, rank, world, schedule, steps=STEPS):
    from transformers import AutoModelForCausalLM

    from lmtrain.model import pipeline

    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(config(kind), attn_implementation="sdpa")
    assert not pipeline.problems(lm, world, schedule)
    smap = pipeline.stage_map(lm, world, schedule)
    mine = pipeline.build_stages(lm, smap, rank)
    pipe = pipeline.Pipeline(mine, len(smap.layers), dist.group.WORLD, torch.device("cpu"), schedule,
                             GLOBAL_BATCH // MICRO, tied_group=dist.group.WORLD)  # 2 ranks: both ends
    from lmtrain.model.tensor_parallel import clip_grad_norm_  # the module's own clipping rule

    params = [p for _, m in mine for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2, foreach=True)
    out = []
    for step in range(steps):
        ids = batch(step)
        loss = pipe.step(ids, ids)
        # every stage's squared norms added, a tied weight's copy counted once: the whole model's norm
        norm = clip_grad_norm_(params, 0.5, across=dist.group.WORLD, uncounted=pipe.duplicates)
        opt.step()
        opt.zero_grad()
        total = loss.detach() if loss is not None else torch.zeros(())
        dist.all_reduce(total)  # the loss lives on the last stage's rank
        out.append([float(total), float(norm)])
    return out


def run(rank, world, path, archs, schedules, steps):
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result = {}
    for arch in archs:
        kind, _, own = arch.partition(":")
        result[kind] = {"ddp": ddp(kind, rank, world, steps)}
        for schedule in own.split("+") if own else schedules:
            result[kind][schedule] = pipelined(kind, rank, world, schedule, steps)
    finish(rank, result, path)


if __name__ == "__main__":
    args = sys.argv[1:]
    spawn(run, 2, args[0], args[1].split(",") if len(args) > 1 else list(ARCHS),
          args[2].split(",") if len(args) > 2 else list(SCHEDULES), int(args[3]) if len(args) > 3 else STEPS)
