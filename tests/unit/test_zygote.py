"""Local ranks forked from a zygote (lmtrain.local.zygote) behave as plain `python` processes would: the
code they run comes from their own PYTHONPATH (the run's snapshot), they see exactly their own
environment, thread count and Lightning rank, they end with the interpreter's exit codes (signals
negative, as Popen says), join their threads and run their atexit handlers; a launch whose
environment differs where the frameworks read it at import gets plain processes; and a run trained
through the zygote is bit-identical to one trained with plain processes."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
from waiting import HANG_S  # tests/waiting.py: a hang guard, not a verdict on speed

from launcher.submit.local_run import prepare_local_run
from lmtrain.local.launch import launch, worker_env
from lmtrain.local.zygote import Zygote, forkable

PROBE = r'''
import atexit, json, os, sys, threading, time
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only
import probe_helper
what = sys.argv[1]
out = {"helper": probe_helper.__file__, "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(),
       "env": dict(os.environ), "threads": torch.get_num_threads(), "rank_zero": rank_zero_only.rank,
       "main": __name__}
print(json.dumps(out), flush=True)
if what == "exit3":
    sys.exit(3)
if what == "raise":
    raise ValueError("from the rank")
if what == "term":
    os.kill(os.getpid(), 15)
    time.sleep(5)
if what == "late":  # a non-daemon thread and an atexit handler: both must run before the exit
    atexit.register(lambda: open(sys.argv[2] + ".atexit", "w").write("ran"))
    threading.Thread(target=lambda: (time.sleep(0.5), open(sys.argv[2] + ".thread", "w").write("ran"))).start()
'''


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    where = tmp_path_factory.mktemp("zygote")
    env = worker_env(0, 2, port=29500, job_id="z", plan_env={}, threads=1)
    z = Zygote.start(env, where / "sock", log=open(where / "zygote.log", "ab"))
    assert z is not None, (where / "zygote.log").read_text()
    yield z
    z.close()


def _rank(zygote, tmp_path, rank: int, what: str, **extra_env):
    code_dir = tmp_path / "code"
    code_dir.mkdir(exist_ok=True)
    (code_dir / "probe_helper.py").write_text("")
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = worker_env(rank, 2, port=29500, job_id="z", plan_env={"PYTHONPATH": str(code_dir), "OMP_NUM_THREADS": "2",
                                                               "LMLAUNCH_PROBE": "yes", **extra_env}, threads=2)
    out = open(tmp_path / f"rank-{rank}.out", "wb")
    cmd = [sys.executable, "-u", str(script), what, str(tmp_path / what)]
    return zygote.fork(cmd, env, tmp_path, out.fileno(), out.fileno()), env


def _said(tmp_path, rank: int) -> tuple[dict, str]:
    text = (tmp_path / f"rank-{rank}.out").read_text()
    return json.loads(text.splitlines()[0]), text


def test_a_forked_rank_runs_its_own_code_with_its_own_environment_rank_and_threads(zygote, tmp_path):
    proc, env = _rank(zygote, tmp_path, 1, "ok")
    assert proc is not None, zygote.refusals
    assert proc.wait(timeout=HANG_S) == 0
    said, _ = _said(tmp_path, 1)
    assert said["helper"] == str(tmp_path / "code" / "probe_helper.py")  # from the rank's PYTHONPATH
    assert said["argv"][0] == str(tmp_path / "probe.py") and said["path0"] == str(tmp_path) and said["main"] == "__main__"
    assert said["cwd"] == str(tmp_path)
    assert {k: v for k, v in said["env"].items() if k in env} == env  # every variable of its own
    assert set(said["env"]) - set(env) <= {"TORCHINDUCTOR_CACHE_DIR", "PYTORCH_NVML_BASED_CUDA_CHECK"}  # what torch's import sets
    assert said["threads"] == 2 and said["rank_zero"] == 1


@pytest.mark.parametrize("what, code", [("exit3", 3), ("raise", 1), ("term", -signal.SIGTERM)])
def test_a_forked_rank_ends_with_the_interpreters_exit_code(zygote, tmp_path, what, code):
    proc, _ = _rank(zygote, tmp_path, 1, what)
    assert proc is not None and proc.wait(timeout=HANG_S) == code
    if what == "raise":
        assert "ValueError: from the rank" in _said(tmp_path, 1)[1]


def test_a_forked_rank_joins_its_threads_and_runs_atexit_before_it_exits(zygote, tmp_path):
    proc, _ = _rank(zygote, tmp_path, 0, "late")
    assert proc is not None and proc.wait(timeout=HANG_S) == 0
    assert (tmp_path / "late.thread").read_text() == "ran" and (tmp_path / "late.atexit").read_text() == "ran"


def test_a_rank_is_stopped_and_killed_like_a_process(zygote, tmp_path):
    proc, _ = _rank(zygote, tmp_path, 1, "term")  # ends itself with SIGTERM
    assert proc is not None and proc.wait(timeout=HANG_S) == -signal.SIGTERM and proc.poll() == -signal.SIGTERM
    proc.kill()  # after the end: nothing happens


def test_an_environment_the_imports_read_differently_gets_a_plain_process(zygote, tmp_path):
    proc, _ = _rank(zygote, tmp_path, 1, "ok", HF_HOME=str(tmp_path / "hf"))
    assert proc is None and "HF_HOME" in zygote.refusals[-1]
    assert forkable([sys.executable, "-c", "print(1)"]) is None and forkable(["/usr/bin/python3", "x.py"]) is None


def test_a_run_through_the_zygote_is_bit_identical_to_one_with_plain_processes(repo, runs_root, monkeypatch):
    overrides = ["model.config.n_layer=1", "model.config.n_embd=32", "model.config.n_head=2", "model.config.n_positions=32",
                 "data.seq_len=32", "trainer.log_every_n_steps=1", "trainer.val_check_interval=null"]
    steps = {}
    for how in ("plain", "zygote"):
        monkeypatch.setenv("LMTRAIN_ZYGOTE", "off") if how == "plain" else monkeypatch.delenv("LMTRAIN_ZYGOTE", raising=False)
        plan = prepare_local_run(str(repo / "jobs" / "tiny-cpu.yaml"), overrides, devices=2, max_steps=4, name=how,
                                 environ=dict(os.environ), say=lambda *_: None, resume=False)
        out = Path(plan.paths.run_dir) / "launcher.out"
        assert launch(plan.paths.run_dir, 2, plan_env=plan.env, threads_per_proc=1, out=open(out, "w")) == 0, out.read_text()
        beats = [json.loads(x) for x in Path(plan.paths.heartbeat).read_text().splitlines()]
        steps[how] = [(b["step"], b["loss"], b["grad_norm"]) for b in beats if b["event"] == "step"]
        assert (Path(plan.paths.run_dir, "logs", "local", "zygote.log").exists()) == (how == "zygote")
    assert len(steps["plain"]) == 4 and steps["plain"] == steps["zygote"]


def test_ctrl_c_reaches_the_ranks_not_the_zygote(zygote, tmp_path):
    """Ctrl-C in the launcher's terminal signals the whole process group: the zygote must live on
    to report its ranks' exits (and serve the next ones); a rank gets KeyboardInterrupt as usual."""
    zygote.proc.send_signal(signal.SIGINT)
    proc, _ = _rank(zygote, tmp_path, 1, "ok")
    assert zygote.proc.poll() is None and proc is not None and proc.wait(timeout=HANG_S) == 0
