"""The doctor's rules on made-up facts (launcher.doctor.checks.judge_*): what each cluster setup means
for this job. The same rules run against the real local cluster in integration/test_doctor.py."""

from __future__ import annotations

import dataclasses

import pytest

from launcher.doctor import checks as doctor
from launcher.planning.resolve import resolve
from launcher.spec.profiles import load_profile
from lmcore.job.parallelism import Parallelism

ENV = {"LMLAUNCH_RUNS_ROOT": "/runs", "HOME": "/home/u", "USER": "u"}
PART = {"PartitionName": "low", "State": "UP", "MaxTime": "02:00:00", "TotalNodes": "2", "MaxNodes": "UNLIMITED",
        "AllowAccounts": "ALL", "AllowQos": "ALL", "PreemptMode": "REQUEUE", "GraceTime": "30"}
CONFIG = {"PreemptType": "preempt/partition_prio", "PreemptMode": "REQUEUE", "SlurmctldParameters": "(null)",
          "JobRequeue": "1"}


@pytest.fixture
def plan(repo):
    return resolve(str(repo / "jobs" / "tiny-cpu.yaml"), [], cluster="local", environ=ENV).plan


@pytest.fixture
def profile():
    return load_profile("local", ENV)


@pytest.mark.parametrize("change, words", [
    ({"State": "DOWN"}, "its State is DOWN"),
    ({"MaxTime": "00:10:00"}, "resources.time 00:20:00 is above its MaxTime 00:10:00"),
    ({"TotalNodes": "1"}, "asks for 2 nodes and it has 1"),
    ({"MaxNodes": "1"}, "its MaxNodes is 1"),
])
def test_a_partition_that_cannot_take_the_job_fails(plan, change, words):
    c = doctor.judge_partition(plan, {**PART, **change})
    assert c.status == "fail" and words in c.message, c
    assert doctor.judge_partition(plan, PART).status == "ok"
    assert doctor.judge_partition(plan, None).status == "fail"


def test_an_account_the_partition_does_not_allow_fails(plan):
    slurm = dataclasses.replace(plan.slurm, account="physics")
    c = doctor.judge_partition(dataclasses.replace(plan, slurm=slurm), {**PART, "AllowAccounts": "bio,chem"})
    assert c.status == "fail" and "account physics is not in its AllowAccounts=bio,chem" in c.message


@pytest.mark.parametrize("mode, status, words", [
    ("REQUEUE", "ok", "PreemptMode=REQUEUE"),
    ("CANCEL", "warn", "lmtrain requeues it itself (scontrol requeue from within the GraceTime"),
    ("SUSPEND,GANG", "warn", "suspended"),
])
def test_preempt_mode(plan, profile, mode, status, words):
    checks = doctor.judge_preemption(plan, profile, CONFIG, {**PART, "PreemptMode": mode}, None, 1.0)
    first = checks[0]
    assert first.status == status and words in first.message, first


def test_a_cluster_that_never_preempts_a_partition_marked_preemptible_warns(plan, profile):
    checks = doctor.judge_preemption(plan, profile, {**CONFIG, "PreemptType": "preempt/none"}, PART, None, 1.0)
    assert checks[0].status == "warn" and "nothing will preempt it" in checks[0].message


def test_the_user_signal_setting_must_match_the_profile(plan, profile):
    checks = doctor.judge_preemption(plan, profile, {**CONFIG, "SlurmctldParameters": "preempt_send_user_signal"},
                                     PART, None, 1.0)
    sig = [c for c in checks if c.name == "preemption signal"]
    assert sig and sig[0].status == "warn" and "sends the user signal" in sig[0].message


@pytest.mark.parametrize("measured, estimated, status", [
    (48.0, 1.0, "fail"),   # the run's own stop checkpoint took longer than GraceTime: work is lost
    (None, 45.0, "warn"),  # only an estimate says so
    (12.0, 99.0, "ok"),    # measured wins over the estimate
    (20.0, 1.0, "warn"),   # one save fits, but a stop that first finishes a background save (2 x 20 s) does not
])
def test_grace_time_against_the_checkpoint(plan, profile, measured, estimated, status):
    checks = doctor.judge_preemption(plan, profile, CONFIG, PART, measured, estimated)
    grace = [c for c in checks if c.name == "grace time"][0]
    assert grace.status == status, grace
    assert grace.figures["measured"] is (measured is not None)


def test_grace_time_covers_a_stop_during_a_background_save_only_when_saves_are_in_the_background(repo, profile):
    """A stop first finishes a periodic save still being written (checkpoint.async_save): twice the
    save must fit in GraceTime; with synchronous periodic saves once is enough."""
    for async_save, status in ((True, "warn"), (False, "ok")):
        plan = resolve(str(repo / "jobs" / "tiny-cpu.yaml"), [f"checkpoint.async_save={str(async_save).lower()}"],
                       cluster="local", environ=ENV).plan
        [grace] = [c for c in doctor.judge_preemption(plan, profile, CONFIG, PART, 20.0, 1.0) if c.name == "grace time"]
        assert grace.status == status, grace
        if status == "warn":
            assert "up to 40 s" in grace.message and "checkpoint.async_save: false" in grace.message


def test_data_rules():
    meta = {"vocab_size": 260, "num_tokens": 1000}
    assert [c.status for c in doctor.judge_data("/d", meta, None, 260, 500)] == ["ok", "ok"]
    vocab, size = doctor.judge_data("/d", meta, None, 200, 5000)
    assert vocab.status == "fail" and "model.config.vocab_size=260" in vocab.message
    assert size.status == "warn" and "5.0 epochs" in size.message
    [missing] = doctor.judge_data("/d", None, "no such directory", 260, 500)
    assert missing.status == "fail" and missing.name == "data"


def test_space_and_checkpoint_size():
    assert doctor.checkpoint_bytes(1_000_000, Parallelism.of("ddp", 2), "32-true") == 12_000_000
    assert doctor.checkpoint_bytes(1_000_000, Parallelism.of("deepspeed", 2, zero_stage=3), "bf16-mixed") == 14_000_000
    assert doctor.checkpoint_bytes(1_000_000, Parallelism.of("deepspeed", 2, zero_stage=3), "32-true") == 12_000_000
    assert doctor.judge_space("checkpoint space", "/c", 10, True, None, 100, "x").status == "fail"
    assert doctor.judge_space("checkpoint space", "/c", 1000, True, None, 100, "x").status == "ok"
    assert doctor.judge_space("checkpoint space", "/c", 1000, False, "Read-only file system", 100, "x").status == "fail"


def test_a_mixture_of_stores_tokenized_differently_is_named():
    """The key the runtime compares stores by (lmcore.run.token_meta): vocabulary, eos, kind, class."""
    bpe = {"vocab_size": 300, "eos_id": 0, "tokenizer": {"kind": "huggingface", "class": "PreTrainedTokenizerFast"}}
    other_class = {**bpe, "tokenizer": {"kind": "huggingface", "class": "GPT2TokenizerFast"}}
    assert doctor.judge_mixture(["/a", "/b"], [bpe, dict(bpe)]).status == doctor.OK
    bad = doctor.judge_mixture(["/a", "/b"], [bpe, other_class])
    assert bad.status == doctor.FAIL and bad.message.startswith("/b was tokenized with (300, 0, 'huggingface')")
