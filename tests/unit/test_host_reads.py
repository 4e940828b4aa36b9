"""No host sync per step from logging, the heartbeat or the stop agreement: the project's
training path (DDP on 2 ranks on gloo, one process, ZeRO-2 on 2 ranks), with every read of a
tensor's value on the host and every DeepSpeed accelerator synchronize counted per optimizer step
and by who asked (tests/unit/_count_host_reads.py); one process runs without a data-parallel
wrapper.

On a GPU such a read waits for all queued kernels. lmtrain's own code may read on the host only
on logging steps (the logged loss and gradient norm), plus, every step, two reads of CPU
tensors that never touch the accelerator: the stop agreement's flags (lmtrain.preemption.agreement, a CPU
tensor on a gloo group of its own) and the sampler's index permutation (lmtrain.data.loader). The
libraries' reads on non-logging steps are held too (found this way: transformers' packed-sequence
check, lmtrain.model.masks; Lightning's SIGTERM broadcast; ZeRO's overflow and norm checks,
lmtrain.distributed.zero_syncs): only torch's optimizer reading its CPU step counters is left."""

from __future__ import annotations

import io
import json
import os
import sys
from collections import Counter
from pathlib import Path

import pytest

from launcher.submit.local_run import prepare_local_run
from lmtrain.local.launch import launch

HELPER = Path(__file__).with_name("_count_host_reads.py")
LOG_EVERY = 5
MAX_STEPS = 12
OVERRIDES = [
    "model.config.n_layer=1", "model.config.n_embd=32", "model.config.n_head=2", "model.config.n_positions=32",
    "data.seq_len=32", "data.micro_batch_size=4", "trainer.global_batch_size=16",  # 2 micro batches per step
    f"trainer.log_every_n_steps={LOG_EVERY}", f"logging.heartbeat_every_n_steps={LOG_EVERY}",
    "trainer.val_check_interval=null", "checkpoint.every_n_steps=100",
]
OURS = ("/lmtrain/", "/launcher/")  # the run's code snapshot (RUN_DIR/code) or the checkout
SYNC = ("accelerator", "synchronize")  # DeepSpeed's accelerator synchronize, whoever calls it

# (ranks, overrides, the strategy's class, the class it wraps the module in). One process runs
# without a data-parallel wrapper; ZeRO's throughput timers (two device syncs a micro step) are off.
CASES = {
    "ddp": (2, [], "DDPStrategy", "DistributedDataParallel"),
    "one-process": (1, [], "SingleDeviceStrategy", "LMModule"),
    # in bf16, as the GPU specs run it: DeepSpeed's overflow check and its clip's norm check read
    # on the host every step unless lmtrain.distributed.zero_syncs and the plan's bf16 config stop them
    "zero2": (2, ["trainer.strategy=deepspeed", "trainer.zero_stage=2", "trainer.precision=bf16-mixed"],
              "CPUDeepSpeedStrategy", "DeepSpeedEngine"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_lmtrain_reads_device_values_on_logging_steps_only(repo, runs_root, case):
    ranks, extra, strategy, wrapper = CASES[case]
    plan = prepare_local_run(str(repo / "jobs" / "tiny-cpu.yaml"), [*OVERRIDES, *extra], devices=ranks,
                             max_steps=MAX_STEPS, name=f"host-reads-{case}", environ=dict(os.environ), new=True,
                             say=lambda *_: None)
    out = io.StringIO()
    code = launch(plan.paths.run_dir, ranks, plan_env=plan.env, out=out,
                  command=[sys.executable, "-u", str(HELPER), plan.paths.run_dir])
    assert code == 0, out.getvalue()[-4000:]
    wrapping = json.loads(Path(plan.paths.run_dir, "wrapping.json").read_text())
    # every process group destroyed before the interpreter's teardown (gloo's threads can abort it)
    assert wrapping == {"strategy": strategy, "model": wrapper, "group_left": True}, wrapping
    reads = json.loads(Path(plan.paths.run_dir, "host-reads.json").read_text())
    assert sorted(map(int, reads)) == list(range(1, MAX_STEPS + 1))
    micro_batches = 16 // 4 // ranks  # global batch 16, micro batch 4
    for step_text, calls in reads.items():
        step = int(step_text)
        ours = Counter((Path(f).name, fn) for f, fn in calls if any(part in f for part in OURS))
        assert (step, Counter(tuple(c) for c in calls)[SYNC]) == (step, 0)
        logging_step = step % LOG_EVERY == 0 or step == MAX_STEPS
        if logging_step:  # the logged loss and gradient norm
            assert ours.pop(("module.py", "_log_step_metrics"), 0) == 1, (step, ours)
            assert ours.pop(("module.py", "_read_grad_norm"), 0) == 1, (step, ours)
        if step == 2:  # entering the second optimizer step, once: what each rank holds (lmtrain.model.memory_held)
            ours.pop(("memory_held.py", "_gather"), None)
        if step < MAX_STEPS:  # (the last one also validates and ends the data iterator)
            # every step: the stop flags and the sampler's indices (one read a micro batch), both
            # CPU tensors; nothing else
            assert ours == Counter({("agreement.py", "_exchange"): 1, ("loader.py", "_rank_batch"): micro_batches}), \
                (step, ours)
        if not logging_step:  # the libraries' reads: torch's optimizer reading its CPU step counters only
            theirs = Counter((Path(f).name, fn) for f, fn in calls if not any(part in f for part in OURS)
                             and tuple((f, fn)) != SYNC)
            theirs.pop(("optimizer.py", "_get_value"), None)
            if step == 2:  # the memory measurement's all_gather_object (lmtrain.model.memory_held), once
                for key in (("distributed_c10d.py", "all_gather_object"), ("distributed_c10d.py", "_tensor_to_object")):
                    theirs.pop(key, None)
            assert not theirs, (step, theirs)
