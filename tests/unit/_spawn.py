"""Test helpers' process start: ``spawn(run, world, *args)`` runs ``run(rank, world, *args)`` in
``world`` processes that meet over gloo on a free loopback port; ``finish`` writes rank 0's
result as JSON and parts from the process group."""

import json
import os
import socket

import torch.distributed as dist
import torch.multiprocessing as mp


def spawn(run, world, *args):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    mp.spawn(run, args=(world, *args), nprocs=world)


def finish(rank, result, path):
    if rank == 0:
        with open(path, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()
