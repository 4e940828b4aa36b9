"""Checkpoint stall and durability through the project's real path, against dd and a plain
torch.save measured in the same run.

A GPT-2 124M (fp32 weights + AdamW state: about 1.5 GB in Lightning's checkpoint file) trains
on CPU in 2 local processes (DDP on gloo, ``lmtrain.local.launch`` as `lmlaunch run --local` starts
them) for ``--steps`` steps with a periodic checkpoint every 2 steps, written in the background
(checkpoint.async_save), and the final checkpoint, written synchronously. Every save's
heartbeat line says how long training was held (``blocked_s``) and how long until COMPLETE
(``seconds``). Then, on the same filesystem and the same bytes:

- ``dd``: ``dd if=/dev/zero of=F bs=64M count=N conv=fsync`` of the checkpoint file's size;
- ``torch.save``: the checkpoint loaded, ``torch.save`` into a file and fsync (what a save costs
  without lmtrain's protocol: no rank files, manifest, renames, COMPLETE).

Goals, with every file's checksum computed (lmtrain.checkpoint.checksums, always on): **blocked <= 1.5x a
bare copy of the staged bytes into host memory** (the median ``blocked_s`` of the background saves
after the first, which allocates the host buffers and is listed apart, over
``baseline_host_copy_s``: the checkpoint's bytes, or for a sharded strategy the bytes of the files
each rank writes (``staged_bytes_by_rank``: ZeRO-1/2's rank 0 also writes the module state,
``mp_rank_00_model_states.pt``), copied into host memory touched before, median of 3: the least a
consistent snapshot can hold training. A sharded strategy's ranks stage their shares at the same
moment and share the host's memory bandwidth, so its floor is every rank copying its own bytes at
once, in processes of its own, the slowest rank's time (``host_copy_all_ranks_seconds``; an even
half copied by one rank alone is printed as ``baseline_host_copy_one_rank_s``); the ratio to the synchronous save's call is still printed) and **durable <= 1.15x dd** (the synchronous save's ``seconds`` — nothing
else runs then; from the save's start to its COMPLETE marker, fsynced: the deletion of the
checkpoint it supersedes comes after and is listed apart as ``sync_save_call_s`` — over dd's
median of 3). The background saves' durable times are listed too:
their writer shares the 2 cores with the training. The page cache is dropped (root) before the
run and before every baseline measurement.

``--strategy`` fsdp, zero1, zero2 or zero3 runs the same model on a sharded strategy: every rank
stages only its own shards and its own thread writes them (lmtrain.checkpoint.async_sharded); the sizes and
the dd baseline are then those of the whole ``lightning.ckpt`` directory (all ranks' files), and
the plain ``torch.save`` baseline, which reads DDP's single file, is not taken.

Ends with one JSON object: the figures, the baselines and ``meets_goal``.

    python bench/checkpoint_io.py [--steps 8] [--params 124e6] [--strategy ddp]

``--params 1.1e9`` (the 1.1B Llama shape): needs about 2 x 17.6 GB for the two ranks' weights,
gradients and AdamW state plus 13 GB of staging; the bench refuses it where the machine's
memory cannot hold that (it says how much it needs).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GOAL_BLOCKED_FLOOR = 1.5  # training held at most 1.5x a bare copy of the staged bytes into host memory
GOAL_DURABLE = 1.15
STRATEGIES = {  # --strategy -> overrides
    "ddp": ("trainer.strategy=ddp",),
    "fsdp": ("trainer.strategy=fsdp",),
    **{f"zero{z}": ("trainer.strategy=deepspeed", f"trainer.zero_stage={z}") for z in (1, 2, 3)},
}
SHAPES = {  # --params -> the model overrides (GPT-2 124M, or Llama 1.1B: jobs/llama-1b-zero2.yaml)
    "124e6": ("jobs/gpt2-124m.yaml", ()),
    "1.1e9": ("jobs/llama-1b-zero2.yaml", ("trainer.zero_stage=null",)),
}


def _mem_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 0


def require_memory(params: str) -> None:
    """Stop, saying why, where two ranks of this shape cannot fit in this machine's memory."""
    need = {"124e6": 8 << 30, "1.1e9": 50 << 30}[params]
    if _mem_total() < need:
        raise SystemExit(f"--params {params} needs about {need >> 30} GiB of memory (two ranks' weights, gradients "
                         f"and AdamW state, plus the staging copy); this machine has {_mem_total() >> 30} GiB")


def train(spec: str, extra: tuple[str, ...], work: Path, steps: int) -> tuple[Path, list[dict]]:
    from launcher.submit.local_run import prepare_local_run
    from lmcore.jsonlines import read_jsonl
    from lmtrain.local.launch import launch

    overrides = [
        f"data.path={REPO / 'data' / 'prepared' / 'tiny'}", "data.seq_len=32", "data.micro_batch_size=1",
        "data.num_workers=0", "trainer.global_batch_size=2", "trainer.precision=32-true",
        "trainer.val_check_interval=null", "trainer.limit_val_batches=0", "trainer.log_every_n_steps=1",
        "model.compile=false", "checkpoint.every_n_steps=2", "checkpoint.keep_last=2", "checkpoint.async_save=true",
        "watchdog.hang_timeout_s=1200", *extra,
    ]
    env = {**os.environ, "LMLAUNCH_RUNS_ROOT": str(work / "runs")}
    plan = prepare_local_run(str(REPO / spec), overrides, devices=2, max_steps=steps, name="ckpt-io", environ=env,
                             new=True, say=lambda m: print(m, file=sys.stderr))
    code = launch(plan.paths.run_dir, 2, plan_env=plan.env, out=sys.stderr, threads_per_proc=1)
    if code != 0:
        raise SystemExit(f"the training run failed (exit {code}); logs in {plan.paths.run_dir}/logs")
    saves = [b for b in read_jsonl(plan.paths.heartbeat) if b.get("event") == "checkpoint"]
    return Path(plan.paths.checkpoint_dir), saves


def drop_page_cache() -> bool:
    """Write back and drop the page cache (root only): a cache full of earlier files makes every
    write reclaim pages first (seen here: the same torch.save 1.2 s with an empty cache, 4 s with
    15 GB cached). Every measurement of this bench starts from the same empty cache."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


def median_of(runs: int, measure) -> float:
    times = []
    for _ in range(runs):
        drop_page_cache()
        times.append(measure())
    return statistics.median(times)


def dd_seconds(path: Path, size: int) -> float:
    block = 64 << 20
    t0 = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", f"bs={block}", f"count={max(1, round(size / block))}",
                    "conv=fsync", "status=none"], check=True)
    seconds = time.perf_counter() - t0
    path.unlink()
    return seconds


def torch_save_seconds(ckpt_file: Path, target: Path) -> float:
    import torch

    state = torch.load(ckpt_file, map_location="cpu", weights_only=True, mmap=True)
    state = {k: v for k, v in state.items()}
    t0 = time.perf_counter()
    with open(target, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    target.unlink()
    return seconds


def host_copy_seconds(nbytes: int) -> float:
    """The physical floor of what a consistent snapshot holds training for: ``nbytes`` copied
    into host memory that was touched before (the staging buffers are reused save after save)."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros_like(src)  # touched: no first-use page faults in the timing
    t0 = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - t0


_COPY_AT_ONCE = """
import sys, time, pathlib, torch
torch.set_num_threads(1)  # as each rank runs (one thread per rank on this machine)
n, go = int(sys.argv[1]), pathlib.Path(sys.argv[2])
src = torch.ones(n, dtype=torch.uint8)
dst = torch.zeros_like(src)  # touched: no first-use page faults in the timing
print("ready", flush=True)
while not go.exists():
    time.sleep(0.001)
t0 = time.perf_counter()
dst.copy_(src)
print(time.perf_counter() - t0, flush=True)
"""


def staged_bytes_by_rank(ckpt: Path, ranks: int) -> list[int]:
    """The bytes of the files each rank of a sharded checkpoint writes (and so stages): DeepSpeed's
    ``zero_pp_rank_R_...`` and DCP's ``__R_0.distcp`` are rank R's; the rest (ZeRO-1/2's module
    state ``mp_rank_00_model_states.pt``, DCP's ``.metadata``, ``meta.pt``, ``latest``) rank 0's."""
    out = [0] * ranks
    for f in ckpt.rglob("*"):
        if f.is_file():
            m = re.search(r"zero_pp_rank_(\d+)_|^__(\d+)_\d+\.distcp$", f.name)
            out[int(next(g for g in m.groups() if g is not None)) if m else 0] += f.stat().st_size
    return out


def host_copy_all_ranks_seconds(nbytes: list[int]) -> float:
    """The floor of a sharded strategy's snapshot: every rank copies its own bytes (``nbytes[r]``)
    into host memory touched before, all at the same moment (as the ranks stage their shares: on
    one host they share its memory bandwidth), each in a process of its own; the slowest rank's
    seconds."""
    import subprocess
    import sys

    with tempfile.TemporaryDirectory() as d:
        go = Path(d) / "go"
        procs = [subprocess.Popen([sys.executable, "-c", _COPY_AT_ONCE, str(n), str(go)],
                                  stdout=subprocess.PIPE, text=True) for n in nbytes]
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        go.touch()
        seconds = [float(p.communicate(timeout=120)[0]) for p in procs]
    return max(seconds)


def run(params: str, steps: int, work_root: str | None, strategy: str = "ddp") -> dict:
    spec, extra = SHAPES[params]
    extra = (*extra, *STRATEGIES[strategy])  # the strategy last: the 1.1B shape clears its zero_stage
    require_memory(params)
    work = Path(tempfile.mkdtemp(prefix="lmlaunch-bench-ckpt-io-", dir=work_root))
    try:
        dropped = drop_page_cache()
        t0 = time.time()
        ckpt_dir, saves = train(spec, extra, work, steps)
        train_s = time.time() - t0
        rss_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
        final = max(saves, key=lambda b: b["step"])
        background = [b for b in saves if b["step"] != final["step"]]
        ckpt_file = ckpt_dir / f"step-{final['step']}" / "lightning.ckpt"
        sharded = ckpt_file.is_dir()  # every rank's shards (DeepSpeed, FSDP2's DCP)
        size = sum(f.stat().st_size for f in ckpt_file.rglob("*") if f.is_file()) if sharded else ckpt_file.stat().st_size
        dd = median_of(3, lambda: dd_seconds(work / "dd.bin", size))
        plain = None if sharded else median_of(3, lambda: torch_save_seconds(ckpt_file, work / "plain.pt"))
        # what one rank stages: DDP's rank 0 the whole state; a sharded strategy's every rank the
        # bytes of its own files (ZeRO-1/2's rank 0 the module state besides its share)
        staged = size // 2 if sharded else size
        by_rank = staged_bytes_by_rank(ckpt_file, 2) if sharded else [size]
        one_rank = statistics.median(host_copy_seconds(staged) for _ in range(3))
        # the floor: DDP's rank 0 alone stages (the whole state); a sharded strategy's ranks all
        # stage their own bytes at once, sharing the host's memory bandwidth
        floor = statistics.median(host_copy_all_ranks_seconds(by_rank) for _ in range(3)) if sharded else one_rank
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # the first background save allocates the host buffers (page faults of 1.5 GB); later ones reuse them
    first, steady = background[0], background[1:] or background
    blocked = statistics.median(b["blocked_s"] for b in steady)
    durable = statistics.median(b["seconds"] for b in steady)
    sync = final["seconds"]  # to COMPLETE: durable
    sync_call = final["blocked_s"]  # what a synchronous save holds training for (pruning included)
    return {
        "bench": "checkpoint_io",
        "model": spec, "params": float(params), "ranks": 2, "strategy": f"{strategy} (gloo, CPU)", "steps": steps,
        "checkpoint_bytes": size,
        "background_saves": [{"step": b["step"], "blocked_s": b["blocked_s"], "durable_s": b["seconds"]}
                             for b in background],
        "first_save_blocked_s": first["blocked_s"],
        "blocked_s": round(blocked, 3),
        "background_durable_s": round(durable, 3),
        "sync_save_s": sync,
        "sync_save_call_s": sync_call,  # to COMPLETE, then the pruning of the oldest checkpoint
        "page_cache_dropped": dropped,
        "baseline_dd_s": round(dd, 3),
        "baseline_torch_save_fsync_s": round(plain, 3) if plain is not None else None,
        "dd_gb_s": round(size / dd / 1e9, 3),
        "baseline_host_copy_s": round(floor, 3),  # the staged bytes copied into touched host memory, every staging rank at once
        "baseline_host_copy_one_rank_s": round(one_rank, 3),  # one rank's share copied with nothing beside it
        "staged_bytes_per_rank": staged,  # an even half (sharded) or the whole state (DDP)
        "staged_bytes_by_rank": by_rank,  # the bytes of the files each rank writes: the floor's copies
        "blocked_ratio_to_host_copy": round(blocked / floor, 3),
        "blocked_ratio_to_sync": round(blocked / sync_call, 4),
        "durable_ratio_to_dd": round(sync / dd, 3),
        "background_durable_ratio_to_dd": round(durable / dd, 3),
        "torch_save_ratio_to_dd": round(plain / dd, 3) if plain is not None else None,
        "peak_rss_per_rank_gib": round(rss_gib, 2),
        "train_wall_s": round(train_s, 1),
        "checksums": "xxh3_128, every file (lmtrain.checkpoint.checksums: on, always)",
        "goal_blocked_ratio_to_host_copy": GOAL_BLOCKED_FLOOR, "goal_durable_ratio": GOAL_DURABLE,
        "meets_goal": blocked / floor <= GOAL_BLOCKED_FLOOR and sync / dd <= GOAL_DURABLE,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", choices=sorted(SHAPES), default="124e6")
    p.add_argument("--steps", type=int, default=8, help="even, >= 6: periodic saves every 2 steps, the last synchronous")
    p.add_argument("--strategy", choices=list(STRATEGIES), default="ddp")
    p.add_argument("--dir", default=None, help="where to write (default: the system temp directory)")
    a = p.parse_args(argv)
    if a.steps < 6 or a.steps % 2:
        p.error("--steps must be even and >= 6")
    print(json.dumps(run(a.params, a.steps, a.dir, a.strategy)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
