"""Webhook notifications (spec notify, lmtrain.observe.notify): what each event says, secrets by name,
bounded and never in the way of training; a real local run's messages, in order."""

from __future__ import annotations

import http.server
import io
import json
import socket
import threading
import time
from pathlib import Path

import pytest

from launcher.cli import main
from launcher.context import Context
from lmtrain.observe.notify import Notifier, goodput

HELPER = Path(__file__).with_name("_train_with_stop.py")


class _Hook(http.server.BaseHTTPRequestHandler):
    received: list[dict] = []

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).received.append(json.loads(body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def hook():
    _Hook.received = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook", _Hook.received
    server.shutdown()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_messages_go_out_in_order_with_their_facts_and_only_the_chosen_events(hook):
    url, got = hook
    n = Notifier({"webhooks": [{"url": url}], "events": ["started", "completed"], "timeout_s": 2, "retries": 0},
                 run="r", attempt=2, job_id="7", enabled=True)
    n.send("started", "attempt 2 started", start_step=10)
    n.send("preempted", "not chosen")
    n.send("completed", "done", loss=1.5)
    n.close()
    assert [(m["event"], m["attempt"], m["job_id"], m["run"]) for m in got] == [
        ("started", 2, "7", "r"), ("completed", 2, "7", "r")]
    assert got[0]["text"] == "[r] attempt 2 started" and got[0]["start_step"] == 10 and got[1]["loss"] == 1.5


def test_a_secret_url_comes_from_the_environment_and_other_ranks_send_nothing(hook):
    url, got = hook
    spec = {"webhooks": [{"url_env": "MY_HOOK"}], "events": ["started"], "timeout_s": 2, "retries": 0}
    Notifier(spec, run="r", attempt=1, job_id="1", enabled=False, environ={"MY_HOOK": url}).close()
    n = Notifier(spec, run="r", attempt=1, job_id="1", enabled=True, environ={"MY_HOOK": url})
    n.send("started", "hi")
    n.close()
    assert len(got) == 1


def test_an_unreachable_webhook_never_blocks_the_sender():
    spec = {"webhooks": [{"url": f"http://127.0.0.1:{_closed_port()}/x"}], "events": ["started"],
            "timeout_s": 1, "retries": 2}
    n = Notifier(spec, run="r", attempt=1, job_id="1", enabled=True)
    t0 = time.perf_counter()
    for _ in range(100):
        n.send("started", "hi")
    assert time.perf_counter() - t0 < 1.0  # a queue put each: one send waiting on the network takes timeout_s (1 s)
    t0 = time.perf_counter()
    n.close(wait_s=1.0)
    assert time.perf_counter() - t0 < 1.5  # bounded: gives up on what is left


def test_goodput_from_the_ledger_and_heartbeat():
    ledger = [{"event": "start", "attempt": 1, "time": 0.0}, {"event": "end", "attempt": 1, "time": 100.0},
              {"event": "start", "attempt": 2, "time": 200.0}]
    beats = [{"event": "start", "attempt": 1, "time": 10.0}, {"event": "step", "attempt": 1, "time": 90.0},
             {"event": "start", "attempt": 2, "time": 210.0}, {"event": "step", "attempt": 2, "time": 290.0}]
    assert goodput(ledger, beats, now=300.0) == pytest.approx(160 / 200)


@pytest.mark.parametrize("hooks, words", [
    ("[{url_env: HOOK}]", "url_env HOOK must also be in env.passthrough"),
    ("[{url: 'http://x', url_env: HOOK}]", "exactly one of url and url_env"),
    ("[{url: 'ftp://x'}]", "webhook URL"),
])
def test_a_bad_webhook_is_refused(repo, tmp_path, hooks, words):
    out = io.StringIO()
    code = main(["validate", str(repo / "jobs" / "tiny-cpu.yaml"), f"notify.webhooks={hooks}"],
                Context(stdout=out, stderr=out, environ={"LMLAUNCH_RUNS_ROOT": str(tmp_path)}))
    assert code == 4 and words in out.getvalue(), out.getvalue()


def test_notify_test_sends_one_message_per_webhook(repo, tmp_path, hook):
    url, got = hook
    out = io.StringIO()
    dead = f"http://127.0.0.1:{_closed_port()}/x"
    code = main(["notify-test", str(repo / "jobs" / "tiny-cpu.yaml"), f"notify.webhooks=[{{url: '{url}'}}, {{url: '{dead}'}}]",
                 "notify.retries=0", "notify.timeout_s=1"],
                Context(stdout=out, stderr=out, environ={"LMLAUNCH_RUNS_ROOT": str(tmp_path)}))
    assert code == 1 and "webhook 1" in out.getvalue() and "delivered" in out.getvalue(), out.getvalue()
    assert "webhook 2" in out.getvalue() and "failed" in out.getvalue()
    assert [m["event"] for m in got] == ["test"]


@pytest.mark.slow
def test_a_run_stopped_and_resumed_sends_its_story(repo, runs_root, hook):
    """Attempt 1 is asked to stop at step 3 (as a preemption would), attempt 2 finishes: the
    webhook hears started, preempted, started, completed (a local run is not requeued by SLURM)."""
    import os
    import sys

    from launcher.submit.local_run import prepare_local_run
    from lmtrain.local.launch import launch

    url, got = hook
    overrides = ["model.config.n_layer=1", "model.config.n_embd=32", "model.config.n_head=2",
                 "model.config.n_positions=32", "data.seq_len=32", "data.micro_batch_size=4",
                 "trainer.global_batch_size=4", "trainer.limit_val_batches=0", "optim.warmup_steps=1",
                 f"notify.webhooks=[{{url: '{url}'}}]"]
    for stop_at in (3, 0):
        plan = prepare_local_run(str(repo / "jobs" / "tiny-cpu.yaml"), overrides, devices=1, max_steps=6, name="nt",
                                 environ=dict(os.environ), say=lambda *_: None, resume=(runs_root / "nt").is_dir())
        with open(Path(plan.paths.run_dir) / "launcher.out", "a") as out:
            assert launch(plan.paths.run_dir, 1, plan_env=plan.env, out=out, threads_per_proc=1,
                          command=[sys.executable, "-u", str(HELPER), plan.paths.run_dir, str(stop_at)]) == 0
    assert [(m["event"], m["attempt"]) for m in got] == [
        ("started", 1), ("preempted", 1), ("started", 2), ("completed", 2)], got
    assert got[1]["end_step"] == 3 and got[2]["start_step"] == 3
    assert got[3]["end_step"] == 6 and got[3]["loss"] > 0 and 0 < got[3]["goodput"] <= 1


@pytest.mark.parametrize("reason, requeued, events", [
    ("crashed", False, ["failed"]),
    ("crashed", True, ["requeued"]),  # a crash retry: the job runs again
    ("hang", False, ["hang"]),
    ("timeout", True, ["preempted", "requeued"]),
    ("cancelled", False, []),
])
def test_how_an_attempt_ended_becomes_messages(tmp_path, reason, requeued, events):
    """The entry's end messages: a failure carries the failing rank's last log lines."""
    from types import SimpleNamespace

    from lmtrain.observe.attempt import Outcome
    from lmtrain.observe.notify import notify_end

    logs = tmp_path / "logs" / "attempt-2"
    logs.mkdir(parents=True)
    # the node's log: rank 1's traceback between rank 0's lines (lmcore.run.rank_logs)
    (logs / "node-0.log").write_text("[rank 0] step 5\n[rank 1] step 5\n[rank 1] Traceback (most recent call last):\n"
                                     "[rank 0] all fine\n[rank 1] ValueError: bad batch\n")
    plan = SimpleNamespace(paths=SimpleNamespace(run_dir=str(tmp_path), logs_dir=str(tmp_path / "logs"),
                                                 checkpoint_dir=str(tmp_path / "checkpoints"),
                                                 heartbeat=str(tmp_path / "hb"), ledger=str(tmp_path / "ledger")))
    sent: list[tuple[str, str, dict]] = []
    notifier = SimpleNamespace(send=lambda event, text, **facts: sent.append((event, text, facts)))
    notify_end(notifier, plan, Outcome(reason=reason, end_step=5, detail="ValueError: bad batch", requeued=requeued),
                attempt=2)
    assert [e for e, _, _ in sent] == events
    if events == ["failed"]:
        assert sent[0][2]["log_tail"] == "step 5\nTraceback (most recent call last):\nValueError: bad batch"
        assert "crashed" in sent[0][1]


def test_a_crash_restarted_in_place_says_so():
    from types import SimpleNamespace

    from lmtrain.observe.attempt import Outcome
    from lmtrain.observe.notify import notify_end

    sent: list[tuple[str, str, dict]] = []
    notifier = SimpleNamespace(send=lambda event, text, **facts: sent.append((event, text, facts)))
    notify_end(notifier, SimpleNamespace(), Outcome(reason="crashed", end_step=47, detail="rank 1 on n2 died first",
                                                    requeued=True, action="restart"), attempt=1)
    assert [(e, f.get("restart")) for e, _, f in sent] == [("requeued", "in_place")]
    assert sent[0][1].startswith("restarted in place after crashed at step 47 (the same job and nodes, no queue wait)")
