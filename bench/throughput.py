"""Training throughput: the project's real training path against a baseline, in one process.

For each configuration, one process trains the same model on the same batches twice:

- ``handwritten`` configurations (gpt2-124m, llama-1b, smoke):
  (a) bench/handwritten_loop.py — a hand-written PyTorch loop (torch.compile and fused AdamW on
      CUDA, bf16 autocast, clip 1.0);
  (b) the project's path — ``lmtrain.task.entry.run_task`` on a run directory planned by
      ``launcher.submit.local_run.prepare_local_run`` (``launcher.planning.planner.make_plan`` with the job's
      cluster profile): the same entry, LMModule, callbacks, loggers, strategy and Trainer
      construction a SLURM task runs, in this process (1 rank).
- ``deepspeed`` configurations (zero1, zero2, zero3):
  (a) the project's path with ``trainer.strategy=ddp`` (its own non-DeepSpeed path);
  (b) the project's path with ``trainer.strategy=deepspeed`` and ``zero_stage`` 1, 2 or 3.

Both sides are timed after ``warmup`` steps (compilation, allocator and loader warm-up excluded),
with ``torch.cuda.synchronize()`` at both ends of the timed window. One JSON line per
configuration: tokens/s and MFU of (a) and (b) and the ratio (b)/(a).

Data: the shipped corpus prepared at data/prepared/tiny (byte-level, vocab 260; prepared here
when missing). Both sides read it through the same ``lmtrain.data.loader.make_dataloaders`` with the
same seed, so they train on identical batches in the same order. The models keep their job's
vocabulary (50304 for GPT-2, 32000 for Llama): the ids are < 260, which does not change the
work per token.

MFU = tokens/s x flops_per_token / peak, flops_per_token = 6 N + 12 L H T (N: parameters that
take part in a matmul per token — lmtrain.model.causal_lm.model_shape; L layers, H hidden size, T sequence
length), peak 989.5e12 FLOP/s (H100 SXM / H200 dense bf16). MFU is null on CPU, on other GPUs
and for non-bf16 precision.

    python bench/throughput.py --smoke                 # tiny GPT-2 on CPU, 32-true (< 60 s)
    python bench/throughput.py --config gpt2-124m      # one configuration (needs CUDA)
    python bench/throughput.py --config all --out bench/throughput.jsonl   # every GPU config,
                                                       # one subprocess each
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from lmtrain.distributed.task_env import free_port

REPO = Path(__file__).resolve().parents[1]
# Importable without `pip install -e .` (the GPU machine gets the working tree only).
for _p in (REPO / "src", REPO):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
sys.path.insert(0, str(Path(__file__).resolve().parent))

FLOPS_FORMULA = "flops_per_token = 6*N + 12*L*H*T (N = matmul parameters, L layers, H hidden size, T seq len)"
DATA_DIR = REPO / "data" / "prepared" / "tiny"
DATA_NOTE = (
    "shipped corpus data/prepared/tiny (byte-level, vocab 260), identical batches for (a) and (b) "
    "from lmtrain.data.loader.make_dataloaders with the same seed"
)
# Every configuration: no validation and no periodic checkpoint inside the run.
COMMON = ("trainer.val_check_interval=null", "trainer.limit_val_batches=0", "checkpoint.every_n_steps=1000000")
GPT2_124M = (
    "data.micro_batch_size=16", "data.seq_len=1024", "trainer.global_batch_size=16",
    "trainer.precision=bf16-mixed", "trainer.gradient_clip_val=1.0", "trainer.strategy=ddp",
)


@dataclass(frozen=True)
class BenchConfig:
    name: str
    description: str
    spec: str  # a job spec under jobs/
    overrides: tuple[str, ...]
    gpu: bool
    warmup: int
    steps: int
    kind: str = "handwritten"  # handwritten: (a) = hand-written loop; deepspeed: (a) = project ddp
    b_overrides: tuple[str, ...] = ()  # (b) only (the DeepSpeed strategy)


# the tiny job as every CPU smoke configuration trains it
CPU_SMOKE = ("data.micro_batch_size=8", "data.seq_len=128", "trainer.global_batch_size=8", "trainer.precision=32-true",
             "trainer.strategy=ddp", "trainer.gradient_clip_val=1.0", "model.compile=false", "data.num_workers=0")

# host-fsdp and host-ddp: GPT-2 124M's tensors at a width where the per-step host work shows
HOST_SHAPE = ("data.micro_batch_size=4", "data.seq_len=32", "trainer.global_batch_size=4", "trainer.precision=32-true",
              "trainer.strategy=ddp", "trainer.gradient_clip_val=1.0", "model.compile=false", "data.num_workers=0",
              "model.config.n_embd=64", "model.config.n_head=2", "model.config.n_positions=32",
              "model.config.vocab_size=260")

CONFIGS: dict[str, BenchConfig] = {
    c.name: c
    for c in (
        BenchConfig(
            "gpt2-124m", "GPT-2 124M, B=16, T=1024, bf16-mixed, clip 1.0, compile; hand-written loop vs project path",
            "jobs/gpt2-124m.yaml", (*GPT2_124M, "model.compile=true"), gpu=True, warmup=10, steps=50,
        ),
        BenchConfig(
            "llama-1b", "Llama ~1.1B (jobs/llama-1b-zero2.yaml model), B=4, T=2048, bf16-mixed, clip 1.0, compile, "
            "one GPU without DeepSpeed; hand-written loop vs project path",
            "jobs/llama-1b-zero2.yaml",
            ("trainer.strategy=ddp", "trainer.zero_stage=null", "model.compile=true", "data.micro_batch_size=4",
             "data.seq_len=2048", "trainer.global_batch_size=4", "trainer.precision=bf16-mixed",
             "trainer.gradient_clip_val=1.0"),
            gpu=True, warmup=8, steps=30,
        ),
        *(
            BenchConfig(
                f"zero{k}", f"GPT-2 124M, B=16, T=1024, bf16-mixed, clip 1.0, no compile; project path DeepSpeed "
                f"ZeRO-{k} on one GPU vs project path DDP (its own non-DeepSpeed path)",
                "jobs/gpt2-124m.yaml", (*GPT2_124M, "model.compile=false"), gpu=True, warmup=10, steps=50,
                kind="deepspeed", b_overrides=("trainer.strategy=deepspeed", f"trainer.zero_stage={k}"),
            )
            for k in (1, 2, 3)
        ),
        BenchConfig(
            "fsdp", "GPT-2 124M, B=16, T=1024, bf16-mixed, clip 1.0, compile (per block, both sides); project path "
            "FSDP2 on one GPU (bf16 gathers, fp32 reduce) vs project path DDP (one process: no wrapper)",
            "jobs/gpt2-124m.yaml", (*GPT2_124M, "model.compile=true"), gpu=True, warmup=10, steps=50,
            kind="deepspeed", b_overrides=("trainer.strategy=fsdp",),
        ),
        BenchConfig(
            "smoke", "CPU smoke: tiny GPT-2 (2 layers, 128 wide), B=8, T=128, 32-true, clip 1.0; "
            "hand-written loop vs project path (not a performance figure)",
            "jobs/tiny-cpu.yaml",
            CPU_SMOKE,
            gpu=False, warmup=3, steps=10,
        ),
        BenchConfig(
            "smoke-deepspeed", "CPU smoke of the deepspeed configurations' mechanics: project path twice in one "
            "process ((a) DDP, (b) DeepSpeed ZeRO-2 on its CPU accelerator; see b_strategy)",
            "jobs/tiny-cpu.yaml",
            CPU_SMOKE,
            gpu=False, warmup=3, steps=10, kind="deepspeed",
            b_overrides=("trainer.strategy=deepspeed", "trainer.zero_stage=2"),
        ),
        *(
            BenchConfig(
                f"host-{b}", f"CPU: {what}: GPT-2 124M's 12 blocks and 148 tensors at 64 wide, B=4, T=32, "
                "32-true, clip 1.0, no compile, so that the arithmetic is small and what the frameworks do around "
                "it (hooks, copies, DTensor dispatch, the optimizer, clipping) is most of a step",
                "jobs/gpt2-124m.yaml", HOST_SHAPE,
                gpu=False, warmup=5, steps=40, kind="deepspeed", b_overrides=(f"trainer.strategy={b}",),
            )
            for b, what in (("fsdp", "the per-step host work of FSDP2 against DDP, one rank each, in one process"),
                            ("ddp", "host-fsdp's control, DDP against DDP (its ratio is the measurement's noise; "
                                    "its profile is the DDP step host-fsdp's FSDP2 step is compared with)"))
        ),
        BenchConfig(
            "smoke-fsdp", "CPU smoke of the fsdp configuration's mechanics: project path twice in one process ((a) "
            "DDP, (b) FSDP2 on a one-rank mesh)",
            "jobs/tiny-cpu.yaml",
            CPU_SMOKE,
            gpu=False, warmup=3, steps=10, kind="deepspeed", b_overrides=("trainer.strategy=fsdp",),
        ),
    )
}
GPU_CONFIGS = ("gpt2-124m", "llama-1b", "zero1", "zero2", "zero3", "fsdp")


# --------------------------------------------------------------------------- environment
def ensure_data(path: Path = DATA_DIR) -> Path:
    """The prepared shipped corpus (``lmlaunch data prepare`` output); made here when missing."""
    from lmtrain.data.prepare.build import prepare, shipped_corpus_files

    if not (path / "meta.json").is_file():
        prepare(shipped_corpus_files(), path, if_missing=True)
    return path


def set_single_rank_env(job_id: str) -> None:
    """This process is rank 0 of 1, as ``lmtrain.local.launch`` starts a rank (lmtrain.distributed.task_env.read_env)."""
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        del os.environ[key]  # not a SLURM task, even inside an allocation
    os.environ.update({
        "LMTRAIN_LAUNCHER": "local", "LMTRAIN_JOB_ID": job_id, "RANK": "0", "LOCAL_RANK": "0",
        "NODE_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": os.environ.get("MASTER_PORT") or str(free_port("127.0.0.1")), "PYTHONUNBUFFERED": "1",
    })


def apply_plan_env(plan) -> list[str]:
    """The plan's process environment minus what is about the cluster fabric (NCCL/IB names,
    run-dir paths) — e.g. CUDA_DEVICE_MAX_CONNECTIONS; set before CUDA starts, for both sides."""
    keep = {k: v for k, v in plan.env.items() if not k.startswith(("NCCL_", "TORCH_NCCL_", "LMLAUNCH_"))}
    from lmtrain.local.launch import planned_over

    merged = planned_over(os.environ, keep)  # an inherited PYTHONPATH kept after the plan's, as jobs do
    os.environ.update({k: merged[k] for k in keep})
    return sorted(keep)


def make_run(cfg: BenchConfig, runs_root: Path, name: str, extra: tuple[str, ...], max_steps: int, data: Path):
    """Plan a 1-rank run of the job (the same planning ``lmlaunch run --local [--gpus]`` does) and
    write its run directory; return the plan."""
    from launcher.submit.local_run import prepare_local_run

    env = {**os.environ, "LMLAUNCH_RUNS_ROOT": str(runs_root)}
    return prepare_local_run(
        str(REPO / cfg.spec), [f"data.path={data}", *COMMON, *cfg.overrides, *extra], devices=1,
        max_steps=max_steps, name=name, environ=env, new=True, gpus=cfg.gpu, say=lambda m: print(m, file=sys.stderr),
    )


def versions() -> dict[str, Any]:
    import lightning
    import torch
    import transformers

    try:
        import deepspeed

        ds = deepspeed.__version__
    except Exception:  # not installed, or its import fails without CUDA tooling
        ds = None
    return {"torch": torch.__version__, "lightning": lightning.__version__,
            "transformers": transformers.__version__, "deepspeed": ds, "python": platform.python_version()}


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"cpu ({platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()})"


def peak_flops(precision: str) -> float | None:
    """Dense peak FLOP/s of this GPU for the precision (lmtrain.model.causal_lm's table, the one the
    training heartbeat's MFU uses: 989.5e12 bf16 for H100 SXM and H200), or None."""
    from lmtrain.model.causal_lm import peak_flops_per_device

    return peak_flops_per_device(precision)


def model_facts(model_spec: dict[str, Any], seq_len: int) -> dict[str, Any]:
    """N, L, H and FLOPs per token of the model, from a meta-device instance (no memory)."""
    import torch

    from lmtrain.model.causal_lm import build_model, model_shape

    with torch.device("meta"):
        shape = model_shape(build_model({**model_spec, "compile": False}, seed=0))
    return {
        "model_type": model_spec.get("type"), "n_params": shape.total_params, "matmul_params": shape.matmul_params,
        "n_layer": shape.n_layer, "hidden_size": shape.d_model,
        "flops_per_token": shape.flops_per_token(seq_len),
    }


def free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    try:
        torch._dynamo.reset()  # drop compiled graphs (and what they hold) of the side that ran first
    except Exception:
        pass


# --------------------------------------------------------------------------- the project path
class SyncLedger:
    """The host syncs of a timed window, filed by optimizer step. A step's syncs run from its batch's
    start to the next batch's start: the module logs, and Lightning's logger reads the logged
    values, after a callback's ``on_train_batch_end``. So each is filed when the next batch starts
    (or the window ends) under the step whose batch ended last."""

    def __init__(self) -> None:
        self._unfiled: list[str] = []
        self._filed: list[tuple[int | None, str]] = []
        self._logging_steps: set[int] = set()
        self._last_end: int | None = None

    def sync(self, where: str) -> None:
        self._unfiled.append(where)

    def batch_start(self) -> None:
        self._filed += [(self._last_end, w) for w in self._unfiled]
        self._unfiled = []

    def batch_end(self, step: int, *, logging: bool) -> None:
        self._last_end = step
        if logging:
            self._logging_steps.add(step)

    def summary(self) -> dict[str, Any]:
        """Totals, those on non-logging steps, and the Python frames of the most frequent of those."""
        from collections import Counter

        self.batch_start()
        off = [w for step, w in self._filed if step not in self._logging_steps]
        return {"total": len(self._filed), "non_logging_steps": len(off), "where": dict(Counter(off).most_common(6))}


def _probe_class():
    import lightning.pytorch as pl
    import torch

    from lmtrain.checkpoint.callback import CheckpointCallback

    class StepProbe(pl.Callback):
        """Times optimizer steps ``start`` .. ``end`` of the project path (CUDA synchronized), notes
        when the first step ended, and turns off the end-of-training checkpoint (after the
        window: its cost is bench/checkpoint_speed.py's subject, and a 1B model's is 13 GB)."""

        def __init__(self, start: int | None, end: int | None, *, save_at_end: bool = False, on_step=None) -> None:
            self.start, self.end, self.save_at_end, self.on_step = start, end, save_at_end, on_step
            self.t0: float | None = None
            self.t1: float | None = None
            self.first_step_done_at: float | None = None  # time.time() after the first step of this fit
            self.first_step: int | None = None
            self._losses: list[Any] = []
            self.max_mem_gib: float | None = None
            self.strategy_name: str | None = None
            # CUDA only: host syncs in the timed window, by step (torch.cuda.set_sync_debug_mode warns
            # on each synchronizing call; the logging steps are allowed theirs)
            self.syncs: dict[str, Any] | None = None
            self._catcher: Any = None
            self._ledger = SyncLedger()
            self._step_now = 0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self._step_now = trainer.global_step + 1
            self._ledger.batch_start()

        def _count_syncs(self, pl_module, on: bool) -> None:
            if pl_module.device.type != "cuda":
                return
            import traceback
            import warnings

            if on:
                self._catcher = warnings.catch_warnings()
                self._catcher.__enter__()
                warnings.simplefilter("always")

                def seen(message, category, filename, lineno, file=None, line=None) -> None:
                    # where the Python side stood when the synchronizing op ran: its innermost frames
                    frames = [f for f in traceback.extract_stack(limit=16)[:-1] if "/warnings.py" not in f.filename]
                    where = " < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[::-1][:5])
                    if "synchronizing CUDA operation" in str(message):
                        self._ledger.sync(where)

                warnings.showwarning = seen
                torch.cuda.set_sync_debug_mode("warn")
                return
            torch.cuda.set_sync_debug_mode(0)
            self._catcher.__exit__(None, None, None)
            self.syncs = self._ledger.summary()

        def _sync(self, pl_module) -> None:
            if pl_module.device.type == "cuda":
                torch.cuda.synchronize(pl_module.device)

        def on_train_start(self, trainer, pl_module) -> None:
            self.strategy_name = type(trainer.strategy).__name__
            if not self.save_at_end:
                for cb in trainer.callbacks:
                    if isinstance(cb, CheckpointCallback):
                        cb.save_at_end = False
            if pl_module.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(pl_module.device)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            step = trainer.global_step
            if self.first_step_done_at is None:
                self._sync(pl_module)
                self.first_step_done_at = time.time()
                self.first_step = step
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            if self.start is not None and step == self.start + 1 or step == self.end:
                self._losses.append(loss.detach())
            self._ledger.batch_end(step, logging=hasattr(pl_module, "_logs_at") and pl_module._logs_at(step))
            if step == self.start and self.t0 is None:
                self._sync(pl_module)
                self.t0 = time.perf_counter()
                self._count_syncs(pl_module, True)
            elif step == self.end and self.t0 is not None and self.t1 is None:
                self._count_syncs(pl_module, False)
                self._sync(pl_module)
                self.t1 = time.perf_counter()
                if pl_module.device.type == "cuda":
                    self.max_mem_gib = torch.cuda.max_memory_allocated(pl_module.device) / 2**30
            if self.on_step is not None:
                self.on_step(step)

        def losses(self) -> list[float]:
            return [float(x.float().item()) for x in self._losses]

    return StepProbe


def run_project_path(run_dir: str | Path, probe) -> None:
    """``lmtrain.task.entry.run_task`` on ``run_dir`` in this process, with ``probe`` after its
    callbacks (``lmtrain.task.fit.Fit.callbacks`` wrapped for the call)."""
    from lmtrain.task import fit
    from lmtrain.task.entry import run_task

    # Lightning's LightningEnvironment.teardown deletes WORLD_SIZE after each fit: set it again.
    set_single_rank_env(os.environ.get("LMTRAIN_JOB_ID") or f"bench-{os.getpid()}")
    own = fit.Fit.callbacks
    fit.Fit.callbacks = lambda self, startup: [*own(self, startup), probe]  # type: ignore[method-assign]
    try:
        code = run_task(run_dir)
    finally:
        fit.Fit.callbacks = own  # type: ignore[method-assign]
    if code != 0:
        logs = sorted(Path(run_dir, "logs").glob("attempt-*/node-0.log"))  # rank 0's lines are marked [rank 0]
        raise RuntimeError(f"the project path exited with code {code}; see {logs[-1] if logs else run_dir}")


def project_side(plan, warmup: int, steps: int) -> dict[str, Any]:
    probe = _probe_class()(warmup, warmup + steps)
    run_project_path(plan.paths.run_dir, probe)
    if probe.t0 is None or probe.t1 is None:
        raise RuntimeError(f"the project path did not reach step {warmup + steps} (run dir {plan.paths.run_dir})")
    t, topo = plan.trainer, plan.topology
    tokens = steps * topo.micro_batch_size * topo.grad_accum * topo.world_size * int(plan.spec["data"]["seq_len"])
    losses = probe.losses()
    out = {
        "name": f"project path ({plan.parallelism.describe()})",
        "strategy": plan.parallelism.strategy, "lightning_strategy": probe.strategy_name, "precision": t.precision,
        "compile": bool(plan.spec["model"].get("compile")), "seconds": probe.t1 - probe.t0, "tokens": tokens,
        "loss_first": losses[0], "loss_last": losses[-1], "max_mem_gib": probe.max_mem_gib,
        # CUDA: host syncs over the timed steps (set_sync_debug_mode), and those on non-logging steps
        # (the goal: 0); None on CPU, where nothing waits
        "host_syncs": probe.syncs,
    }
    del probe
    free_memory()
    return out


def handwritten_side(plan, warmup: int, steps: int) -> dict[str, Any]:
    import torch
    from handwritten_loop import train_handwritten

    from lmtrain.data.loader import make_dataloaders
    from lmtrain.model.module import OptimSettings

    spec, t = plan.spec, plan.trainer
    if plan.topology.grad_accum != 1 or plan.topology.world_size != 1:
        raise RuntimeError("the hand-written baseline trains one micro batch per step on one rank")
    device = torch.device("cuda", 0) if t.accelerator == "gpu" else torch.device("cpu")
    loader, _val, _sampler = make_dataloaders(SimpleNamespace(**spec["data"]), world_size=1, rank=0, seed=plan.training.seed)
    res = train_handwritten(
        spec["model"], OptimSettings.from_spec(spec["optim"], t.max_steps), loader, device=device,
        bf16=device.type == "cuda" and t.precision.startswith("bf16"), clip=plan.training.gradient_clip_val,
        warmup=warmup, steps=steps, seed=plan.training.seed,
    )
    del loader, _val, _sampler
    free_memory()
    return {
        "name": "hand-written loop" + (" (torch.compile)" if res.compiled else ""), "strategy": None,
        "precision": "bf16 autocast" if device.type == "cuda" and t.precision.startswith("bf16") else "fp32",
        "compile": res.compiled, "optimizer": res.optimizer, "seconds": res.seconds, "tokens": res.tokens,
        "loss_first": res.loss_first, "loss_last": res.loss_last, "max_mem_gib": res.max_mem_gib,
    }


# --------------------------------------------------------------------------- one configuration
def run_config(
    cfg: BenchConfig, *, warmup: int, steps: int, work: Path, threads: int, order: str = "ab",
    repeat: int = 1,
) -> dict[str, Any]:
    import torch

    if cfg.gpu and not torch.cuda.is_available():
        raise SystemExit(f"configuration {cfg.name} needs a CUDA GPU (none here); on CPU run --smoke")
    if not cfg.gpu:
        os.environ["OMP_NUM_THREADS"] = str(threads)  # the project path's _configure_torch reads it
        torch.set_num_threads(threads)
    set_single_rank_env(f"bench-{os.getpid()}")
    data = ensure_data()
    max_steps = warmup + steps

    def plans(r: int):
        """Fresh run directories for round ``r`` (a finished run dir would not train again)."""
        a = make_run(cfg, work / "runs", f"bench-{cfg.name}-a{r}", (), max_steps, data) if cfg.kind == "deepspeed" else None
        return a, make_run(cfg, work / "runs", f"bench-{cfg.name}-b{r}", cfg.b_overrides, max_steps, data)

    plan_a, plan_b = plans(0)
    env_applied = apply_plan_env(plan_b) if cfg.gpu else []
    started = time.time()
    # The side that trains first in a process can be slower (seen on CPU: whichever ran first).
    # --repeat N alternates the order (ab, ba, ab, ...); each side reports its best round, and the
    # ratio is the median of the rounds' ratios.
    rounds: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
    for r in range(repeat):
        pa, pb = (plan_a, plan_b) if r == 0 else plans(r)
        for side in order if r % 2 == 0 else order[::-1]:
            if side == "b":
                res = project_side(pb, warmup, steps)
            else:
                res = project_side(pa, warmup, steps) if pa is not None else handwritten_side(pb, warmup, steps)
            res["tokens_per_s"] = res["tokens"] / res["seconds"]
            rounds[side].append(res)
    a = dict(max(rounds["a"], key=lambda x: x["tokens_per_s"]))
    b = dict(max(rounds["b"], key=lambda x: x["tokens_per_s"]))
    facts = model_facts(plan_b.spec["model"], int(plan_b.spec["data"]["seq_len"]))
    peak = peak_flops(plan_b.trainer.precision)
    line: dict[str, Any] = {
        "bench": "throughput", "config": cfg.name, "description": cfg.description,
        "mode": "gpu" if cfg.gpu else "cpu-smoke",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": device_name(), **versions(),
        "data": DATA_NOTE, **facts,
        "seq_len": int(plan_b.spec["data"]["seq_len"]), "micro_batch_size": plan_b.topology.micro_batch_size,
        "tokens_per_step": plan_b.topology.micro_batch_size * int(plan_b.spec["data"]["seq_len"]),
        "precision": plan_b.trainer.precision, "warmup_steps": warmup, "timed_steps": steps, "order": order,
        "repeat": repeat,
        "flops_formula": FLOPS_FORMULA, "peak_flops": peak, "plan_env_applied": env_applied,
        "wall_s": round(time.time() - started, 2),
    }
    for key, side in (("a", a), ("b", b)):
        tps = side["tokens_per_s"]
        side["rounds_tokens_per_s"] = [x["tokens_per_s"] for x in rounds[key]]
        side["mfu"] = tps * facts["flops_per_token"] / peak if peak else None
        line[f"{key}_name"] = side["name"]
        line[f"tokens_per_s_{key}"] = tps
        line[f"mfu_{key}"] = side["mfu"]
        line[key] = side
    line["b_strategy"] = b["strategy"]
    # Each round trains both sides back to back (the order alternating: ab, ba, ...): the ratio is
    # the median of the rounds' own ratios, so a moment the machine was busy moves one pair only.
    pairs = [rb["tokens_per_s"] / ra["tokens_per_s"] for ra, rb in zip(rounds["a"], rounds["b"])]
    line["ratio_pairs"] = pairs
    line["ratio"] = statistics.median(pairs)
    line["ratio_of_best"] = line["tokens_per_s_b"] / line["tokens_per_s_a"]
    line["ratio_meaning"] = (f"tokens/s of (b) {b['name']} / (a) {a['name']}: the median of {len(pairs)} "
                             "alternated pair(s) (--repeat; ABBA from 2)")
    return line


def profile_project_side(cfg: BenchConfig, *, warmup: int, work: Path, dest: Path) -> None:
    """One more run of side (b) with the spec's ``profile`` window over 3 steps after the warm-up
    (outside the timed rounds, so the profiler costs them nothing): its top operators (by CUDA
    self time on a GPU) printed, and the top-ops JSON and the gzipped trace copied into ``dest``."""
    import gzip

    data = ensure_data()
    plan = make_run(cfg, work / "runs", f"bench-{cfg.name}-profile",
                    (*cfg.b_overrides, f"profile.start_step={warmup}", "profile.steps=3"), warmup + 6, data)
    project_side(plan, warmup, 5)
    tops = sorted(Path(plan.paths.run_dir).glob("logs/attempt-*/profile-*/top-rank-0.json"))
    if not tops:
        raise RuntimeError(f"the profiled run wrote no top-rank-0.json under {plan.paths.run_dir}")
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(tops[-1], dest / f"top-{cfg.name}.json")
    trace = tops[-1].with_name("trace-rank-0.json")
    if trace.is_file():
        with open(trace, "rb") as src, gzip.open(dest / f"trace-{cfg.name}.json.gz", "wb") as out:
            shutil.copyfileobj(src, out)
    top = json.loads(tops[-1].read_text())
    print(f"profile of {cfg.name} (b), steps {top['from_step']}-{top['to_step']}: self s, total s, calls, operator",
          file=sys.stderr)
    for op in top["ops"][:15]:
        print(f"  {op['self_s']:9.4f} {op['total_s']:9.4f} {op['calls']:7d}  {op['name'][:90]}", file=sys.stderr)


def emit(line: dict[str, Any], out: Path | None) -> None:
    text = json.dumps(line, sort_keys=False)
    print(text, flush=True)
    if out is not None:
        with open(out, "a") as f:
            f.write(text + "\n")


def run_all(names: list[str], args: argparse.Namespace) -> int:
    """Each configuration in its own process (CUDA, process groups and DeepSpeed state start clean)."""
    failed = 0
    for name in names:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--config", name]
        cmd += ["--order", args.order, "--repeat", str(args.repeat)]
        for flag in ("warmup", "steps"):
            if getattr(args, flag) is not None:
                cmd += [f"--{flag}", str(getattr(args, flag))]
        if args.out is not None:
            cmd += ["--out", str(args.out)]
        print(f"== {' '.join(cmd)}", file=sys.stderr, flush=True)
        code = subprocess.call(cmd)
        if code != 0:
            failed += 1
            emit({"bench": "throughput", "config": name, "error": f"exit code {code}"}, args.out)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=None, help=f"one of {', '.join(CONFIGS)}, or 'all' (the GPU ones)")
    p.add_argument("--smoke", action="store_true", help="the tiny CPU configuration (same as --config smoke)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default: the config's)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default: the config's)")
    p.add_argument("--threads", type=int, default=1, help="torch threads on CPU (default 1: a shared machine)")
    p.add_argument("--order", choices=("ab", "ba"), default="ab", help="which side trains first (default ab)")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds, alternating the order (ABBA...); the ratio is the median of the rounds' ratios, "
                        "each side's tokens/s its best round (default 1; 3 or more for a figure to report)")
    p.add_argument("--out", type=Path, default=None, help="also append the JSON lines to this file")
    p.add_argument("--keep", action="store_true", help="keep the run directories (printed on stderr)")
    p.add_argument("--profile", type=Path, default=None, metavar="DIR",
                   help="after the timed rounds, profile 3 steps of side (b) (torch.profiler): the top operators "
                        "printed, top-<config>.json and trace-<config>.json.gz written into DIR")
    args = p.parse_args(argv)
    name = "smoke" if args.smoke and args.config is None else args.config
    if name is None:
        p.error("give --smoke or --config NAME")
    if name == "all":
        return run_all(list(GPU_CONFIGS), args)
    if name not in CONFIGS:
        p.error(f"unknown --config {name!r}; choose from {', '.join(CONFIGS)}, all")
    cfg = CONFIGS[name]
    warmup = args.warmup if args.warmup is not None else cfg.warmup
    steps = args.steps if args.steps is not None else cfg.steps
    if warmup < 1 or steps < 1 or args.repeat < 1:
        p.error("--warmup, --steps and --repeat must be >= 1")
    work = Path(tempfile.mkdtemp(prefix=f"lmbench-{name}-"))
    try:
        line = run_config(cfg, warmup=warmup, steps=steps, work=work, threads=args.threads, order=args.order,
                          repeat=args.repeat)
        emit(line, args.out)
        if args.profile is not None:
            profile_project_side(cfg, warmup=warmup, work=work, dest=args.profile)
    finally:
        if args.keep:
            print(f"run directories kept under {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
