"""GPU runs through the same entry a SLURM task runs (lmtrain.task.entry via the local launcher, one
process per GPU): GPT-2 with bf16 + torch.compile, and DeepSpeed ZeRO stages 1, 2 and 3 for 50
steps each with a falling loss. Marked ``gpu``; skipped where CUDA is absent.

Run on a GPU machine: ``pytest -m gpu tests/gpu -v``. The cluster profile's NCCL variables
(InfiniBand HCAs, ib0) are not applied here: a single-node test box may have neither.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

REPO = Path(__file__).resolve().parents[2]
GPT2_SMALL = [
    "model.type=gpt2",
    "model.config={n_layer: 4, n_head: 4, n_embd: 256, n_positions: 256, vocab_size: 260, bos_token_id: 256, eos_token_id: 256}",
    "data.seq_len=256",
    "data.micro_batch_size=16",
    "data.num_workers=2",
    "trainer.global_batch_size=16",
    "trainer.log_every_n_steps=5",
    "trainer.val_check_interval=null",
    "trainer.limit_val_batches=4",
    "trainer.gradient_clip_val=1.0",
    "optim.lr=1.0e-3",
    "optim.warmup_steps=5",
    "optim.min_lr=1.0e-4",
    "checkpoint.every_n_steps=25",
]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    from lmtrain.data.loader import prepare, shipped_corpus_files

    out = tmp_path_factory.mktemp("data") / "tiny"
    prepare(shipped_corpus_files(), out)
    return out


def _run(
    tmp_path: Path, name: str, overrides: list[str], data_dir: Path, steps: int, faults: list[dict] | None = None,
) -> list[dict]:
    from launcher.submit.local_run import prepare_local_run
    from lmtrain.local.launch import launch

    spec = REPO / "jobs" / ("gpt2-124m.yaml" if "zero" not in name else "llama-1b-zero2.yaml")
    env = {**os.environ, "LMLAUNCH_RUNS_ROOT": str(tmp_path / "runs")}
    plan = prepare_local_run(
        str(spec), [*GPT2_SMALL, f"data.path={data_dir}", *overrides], devices=1, max_steps=steps,
        name=name, environ=env, gpus=True, resume=(tmp_path / "runs" / name).is_dir(), say=print,
    )
    assert plan.trainer.accelerator == "gpu"
    log = Path(plan.paths.run_dir) / "launcher.out"
    old = os.environ.pop("LMLAUNCH_FAULTS", None)
    if faults:  # the tasks inherit it (lmtrain.faults)
        os.environ["LMLAUNCH_FAULTS"] = json.dumps(faults)
    try:
        with open(log, "w") as out:
            # not the plan's environment: the cluster profile's NCCL variables (InfiniBand) may not
            # fit a single-node test box; the fault seam reads its rules in a task of a run dir
            task_env = {"LMLAUNCH_RUN_DIR": plan.paths.run_dir} if faults else {}
            code = launch(plan.paths.run_dir, 1, plan_env=task_env, out=out)
    finally:
        os.environ.pop("LMLAUNCH_FAULTS", None)
        if old is not None:
            os.environ["LMLAUNCH_FAULTS"] = old
    lines = [json.loads(x) for x in Path(plan.paths.heartbeat).read_text().splitlines()]
    if faults:  # the test killed it
        assert code != 0
        return lines
    assert code == 0, log.read_text()[-6000:]
    ledger = [json.loads(x) for x in Path(plan.paths.ledger).read_text().splitlines()]
    assert ledger[-1]["reason"] == "completed"
    return lines


def _assert_falls(lines: list[dict], factor: float = 0.75) -> None:
    steps = [d for d in lines if d["event"] == "step"]
    assert len(steps) >= 5
    first, last = steps[0]["loss"], steps[-1]["loss"]
    assert last < factor * first, f"loss did not fall: {first:.3f} -> {last:.3f}"
    print(f"loss {first:.3f} -> {last:.3f}; tokens/s {steps[-1]['tokens_per_s']}; mfu {steps[-1]['mfu']}")


def test_gpt2_bf16_compile_trains_through_the_entry(tmp_path, data_dir):
    lines = _run(tmp_path, "gpu-gpt2", ["model.compile=true", "trainer.precision=bf16-mixed"], data_dir, 50)
    _assert_falls(lines)
    steps = [d for d in lines if d["event"] == "step"]
    assert steps[-1]["tokens_per_s"] > 0
    assert steps[-1]["mfu"] is None or 0 < steps[-1]["mfu"] < 1


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_zero_stage_trains_50_steps_with_falling_loss(tmp_path, data_dir, stage):
    pytest.importorskip("deepspeed")
    lines = _run(
        tmp_path, f"gpu-zero{stage}",
        ["trainer.strategy=deepspeed", f"trainer.zero_stage={stage}", "trainer.precision=bf16-mixed",
         "model.compile=false", "model.activation_checkpointing=true"],
        data_dir, 50,
    )
    _assert_falls(lines)
    ckpts = [d for d in lines if d["event"] == "checkpoint"]
    assert [c["step"] for c in ckpts] == [25, 50]


def test_deepspeed_checkpoint_resumes_on_the_same_world_size(tmp_path, data_dir):
    pytest.importorskip("deepspeed")
    over = ["trainer.strategy=deepspeed", "trainer.zero_stage=2", "trainer.precision=bf16-mixed", "model.compile=false"]
    _run(tmp_path, "gpu-zero-resume", over, data_dir, 25)
    lines = _run(tmp_path, "gpu-zero-resume", over, data_dir, 50)  # same run dir: resumes at 25
    starts = [d for d in lines if d["event"] == "start"]
    assert [s["step"] for s in starts] == [0, 25]


def test_fsdp_trains_and_resumes_on_gpu(tmp_path, data_dir):
    """FSDP2 (DCP checkpoint, every rank its own shard) on one GPU with bf16: 25 steps, then the
    same run directory resumes at its step-25 checkpoint and the loss keeps falling to step 50."""
    over = ["trainer.strategy=fsdp", "trainer.precision=bf16-mixed", "model.compile=false"]
    _run(tmp_path, "gpu-fsdp", over, data_dir, 25)
    lines = _run(tmp_path, "gpu-fsdp", over, data_dir, 50)
    assert [s["step"] for s in lines if s["event"] == "start"] == [0, 25]
    _assert_falls(lines)


def _weights(ckpt: Path) -> dict:
    state = torch.load(ckpt / "lightning.ckpt", map_location="cpu", weights_only=False)
    return state["state_dict"]


def test_background_checkpoint_on_gpu_matches_a_synchronous_one_and_resumes(tmp_path, data_dir):
    """The background save stages the CUDA state into pinned host buffers and writes while
    training goes on: its step-10 checkpoint holds the same weights as a synchronous save of the
    same run at step 10 (both runs plan 30 steps: the learning-rate schedule depends on it), and a
    run killed after step 18 resumes from it and reaches step 30 with the uninterrupted run's loss."""
    from lmcore.run.checkpoint_index import complete_checkpoints

    base = ["trainer.precision=32-true", "model.compile=false", "checkpoint.every_n_steps=10", "checkpoint.keep_last=5"]
    sync = _run(tmp_path, "gpu-sync", [*base, "checkpoint.async_save=false"], data_dir, 30)
    bg = _run(tmp_path, "gpu-bg", [*base, "checkpoint.async_save=true"], data_dir, 30)
    saves = [d for d in bg if d["event"] == "checkpoint" and d["step"] == 10]
    assert saves and saves[0].get("blocked_s") is not None, saves
    print(f"background save of step 10: held {saves[0]['blocked_s']:.3f} s, COMPLETE after {saves[0]['seconds']:.3f} s")

    runs = tmp_path / "runs"
    bg10 = {c.step: c.path for c in complete_checkpoints(runs / "gpu-bg" / "checkpoints")}[10]
    sync10 = {c.step: c.path for c in complete_checkpoints(runs / "gpu-sync" / "checkpoints")}[10]
    wa, wb = _weights(sync10), _weights(bg10)
    assert wa.keys() == wb.keys()
    worst = max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa)
    print(f"step-10 weights, background vs synchronous save: max |diff| {worst:.3g}")
    assert worst < 1e-4

    # the same run again, killed after step 18: it resumes from its background save of step 10
    killed = [{"point": "train.batch_end", "step": 18, "action": "kill"}]
    _run(tmp_path, "gpu-bg-killed", [*base, "checkpoint.async_save=true"], data_dir, 30, faults=killed)
    resumed = _run(tmp_path, "gpu-bg-killed", [*base, "checkpoint.async_save=true"], data_dir, 30)
    assert [s["step"] for s in resumed if s["event"] == "start"] == [0, 10]
    la = [d["loss"] for d in sync if d["event"] == "step" and d["step"] == 30]
    lb = [d["loss"] for d in resumed if d["event"] == "step" and d["step"] == 30]
    print(f"loss at step 30: uninterrupted {la}, resumed from the background save {lb}")
    assert la and lb and abs(la[0] - lb[0]) <= 1e-3 * abs(la[0])


@pytest.mark.parametrize("strategy", [["trainer.strategy=ddp"], ["trainer.strategy=fsdp"],
                                      ["trainer.strategy=deepspeed", "trainer.zero_stage=2"],
                                      ["trainer.strategy=deepspeed", "trainer.zero_stage=3"]],
                         ids=["ddp", "fsdp", "zero2", "zero3"])
def test_planned_peak_is_within_10_percent_of_cudas_max_allocated(tmp_path, data_dir, strategy):
    """The plan's per-rank peak (less its framework row: the CUDA context and NCCL are not the
    caching allocator's) against ``torch.cuda.max_memory_allocated`` at the end of the attempt
    (the ledger's memory line), and the held model states against the plan's exactly as on CPU."""
    if "zero" in strategy[-1]:
        pytest.importorskip("deepspeed")
    name = f"gpu-mem-{strategy[-1].split('=')[-1]}"
    _run(tmp_path, name, [*strategy, "trainer.precision=bf16-mixed", "model.compile=false"], data_dir, 5)
    run_dir = tmp_path / "runs" / name
    plan = json.loads((run_dir / "plan.json").read_text())
    rows = {r["name"]: r["bytes"] for r in plan["memory"]["rows"]}
    planned = plan["memory"]["peak"] - rows.get("framework", 0)
    ledger = [json.loads(x) for x in (run_dir / "attempts.jsonl").read_text().splitlines()]
    peak = max(max(e["device_peak"]) for e in ledger if e.get("event") == "memory" and "device_peak" in e)
    print(f"{name}: planned {planned / 1e9:.2f} GB, CUDA max allocated {peak / 1e9:.2f} GB, ratio {planned / peak:.3f}")
    assert abs(planned - peak) <= 0.10 * peak
    from tests.memory_helpers import assert_states_as_planned

    assert_states_as_planned(run_dir)


def test_a_training_process_forked_by_the_task_agent_uses_cuda(tmp_path):
    """The task agent's imports (lmtrain.task.agent, warm restarts) leave CUDA untouched, so the
    training process it forks can use the GPU; on a GPU plan deepspeed is not preloaded."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import os, sys
        from pathlib import Path
        from lmtrain.preemption.signals import own_signals
        from lmtrain.task.agent import AgentSettings, TaskAgent

        settings = AgentSettings(run_dir=Path("."), rank=0, job_id="1", verdict_wait_s=1.0, preload_deepspeed=False)
        assert TaskAgent(settings, own_signals({"signal": "USR2"}))._preload(), "the imports started CUDA"
        pid = os.fork()
        if pid == 0:
            import torch
            ok = torch.ones(4, device="cuda").sum().item() == 4.0
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status))
    """)
    # the repository before what the environment already has (a GPU box's packages may be on PYTHONPATH)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), str(REPO / "src"), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "deepspeed"])
def test_a_rank_slurm_bound_to_one_gpu_trains_on_it_as_cuda_0(monkeypatch, strategy):
    """`--gpu-bind=per_task:1`: local rank 3 of 4 sees one GPU (CUDA_VISIBLE_DEVICES=0); Lightning is given
    that one device (lmtrain.distributed.strategies.bound_devices) and takes cuda:0, where devices=4
    would ask CUDA for four it cannot see. The Trainer is built as a SLURM task's is; no process group starts."""
    import lightning.pytorch as pl

    from lmcore.job.plan import LaunchPlan
    from lmtrain.distributed.strategies import bound_devices, build_strategy
    from lmtrain.distributed.task_env import read_env

    for key, value in {"SLURM_JOB_ID": "1", "SLURM_PROCID": "3", "SLURM_LOCALID": "3", "SLURM_NODEID": "0",
                       "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "4", "SLURM_NNODES": "1",
                       "SLURM_JOB_NODELIST": "g1", "SLURM_STEP_GPUS": "3", "CUDA_VISIBLE_DEVICES": "0"}.items():
        monkeypatch.setenv(key, value)
    from launcher.planning.resolve import resolve

    profiles = Path(os.environ.get("TMPDIR", "/tmp")) / "lmlaunch-gpu-bind-profiles"
    profiles.mkdir(parents=True, exist_ok=True)
    (profiles / "g4.yaml").write_text("partitions: {gpu: {max_time: '1:00:00'}}\ndefault_partition: gpu\n"
                                      "gpus_per_node: 4\nruns_root: /tmp/lmlaunch-gpu-bind-runs\n")
    spec = {"ddp": [], "fsdp": ["trainer.strategy=fsdp"], "deepspeed": ["trainer.strategy=deepspeed", "trainer.zero_stage=2"]}
    plan = resolve(str(REPO / "jobs" / "gpt2-124m.yaml"), ["cluster=g4", "resources.nodes=1", "resources.gpus_per_node=4",
                                                          "resources.time=00:30:00", *spec[strategy], *GPT2_SMALL,
                                                          "trainer.global_batch_size=64"],
                   environ={"LMLAUNCH_PROFILES_DIR": str(profiles), "HOME": str(profiles)}, check_data=False).plan
    plan = LaunchPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    env = read_env()
    s = build_strategy(plan, env)
    kwargs = bound_devices(s, plan.trainer.kwargs(), plan, env)
    assert kwargs["devices"] == 1
    trainer = pl.Trainer(**{**kwargs, "logger": False, "enable_checkpointing": False}, strategy=s)
    assert trainer.strategy.root_device == torch.device("cuda", 0) and trainer.world_size == 4
    assert trainer.global_rank == 3 and trainer.local_rank == 3
