"""Test helpers' process start: ``spawn(run, world, *args)`` runs ``run(rank, world, *args)`` in
``world`` processes that meet over gloo on a free loopback port; ``finish`` writes rank 0's
result as JSON and parts from the process group once every rank is there."""

import json
import os
import socket

import torch.distributed as dist
import torch.multiprocessing as mp


def spawn(run, world, *args, tries=3):
    """The port is free when picked, and may be taken before rank 0's store listens on it (another
    test's, or a job's, connection: seen under the suite's load, EADDRINUSE in rank 0's
    init_process_group): then the ranks start again, on another port, before any trained."""
    for attempt in range(tries):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        try:
            mp.spawn(run, args=(world, *args), nprocs=world)
            return
        except mp.ProcessRaisedException as exc:
            if "EADDRINUSE" not in str(exc) or attempt == tries - 1:
                raise


def finish(rank, result, path):
    if rank == 0:
        with open(path, "w") as f:
            json.dump(result, f)
    # every rank done sending before any tears its groups down: a rank that destroyed its gloo
    # pairs while a peer's last send was still in flight aborted once ("terminate called without
    # an active exception", fresh-clone run R25, the pipeline losses)
    dist.barrier()
    dist.destroy_process_group()
