"""Test helper: per-step losses and gradient norms of tiny causal LMs trained on WORLD processes
(gloo, CPU) as DDP and as tensor-parallel layouts through lmtrain.model.tensor_parallel (and FSDP2 over
the data dimension, as lmtrain.model.module does), every layout on the same global batches.

usage: python _tp_losses.py WORLD OUT.json    (WORLD 2: ddp, tp2, tp2+sp; WORLD 4: ddp, dp2xtp2,
dp2xtp2+sp; each for llama, qwen2 and mistral, tied and untied). Writes
{"<arch>-<tied|untied>": {"<layout>": [[loss, grad_norm], ...]}}.
"""

import os
import sys
import warnings

import torch
import torch.distributed as dist

from tests.unit._spawn import finish, spawn

ARCHS = [(a, tied) for a in ("llama", "qwen2", "mistral") for tied in (True, False)]
STEPS, GLOBAL_BATCH, SEQ, VOCAB = 4, 8, 16, 101


def config(kind, tied):
    from transformers import AutoConfig

    return AutoConfig.for_model(kind, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=VOCAB, tie_word_embeddings=tied,
                                max_position_embeddings=64)


def train(kind, tied, world, rank, tp, sp):
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from lmtrain.model import tensor_parallel
    from lmtrain.model.fsdp2 import shard_fsdp2

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config(kind, tied), attn_implementation="sdpa")
    dp = world // tp
    if tp == 1:  # DDP: the reference
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("data_parallel", "tensor_parallel"))
        tensor_parallel.parallelize(model, mesh["tensor_parallel"], sequence_parallel=sp)
        shard_fsdp2(model, mesh["data_parallel"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    out = []
    for step in range(STEPS):
        batch = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(step))
        per = GLOBAL_BATCH // dp
        mine = batch[(rank // tp) * per:(rank // tp + 1) * per]  # tensor-parallel ranks: the same samples
        extra = {"position_ids": tensor_parallel.position_ids(mine)} if sp else {}
        loss = model(input_ids=mine, labels=mine, use_cache=False, **extra).loss
        loss.backward()
        if tp == 1:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        else:
            norm = tensor_parallel.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        out.append([float(mean) / world, float(norm)])
    return out


def run(rank, world, path):
    warnings.simplefilter("ignore")
    import logging

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    layouts = [("ddp", 1, False), (f"tp{2}" if world == 2 else "dp2xtp2", 2, False),
               (("tp2" if world == 2 else "dp2xtp2") + "+sp", 2, True)]
    result = {}
    for kind, tied in ARCHS:
        result[f"{kind}-{'tied' if tied else 'untied'}"] = {name: train(kind, tied, world, rank, tp, sp)
                                                           for name, tp, sp in layouts}
    finish(rank, result, path)


if __name__ == "__main__":
    spawn(run, int(sys.argv[1]), sys.argv[2])
