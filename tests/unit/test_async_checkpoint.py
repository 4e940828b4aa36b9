"""lmtrain.checkpoint.async_checkpoint: what a background save copies, and how its thread is waited for."""

from __future__ import annotations

import threading
from collections import OrderedDict, defaultdict

import pytest
import torch
from waiting import HANG_S  # tests/waiting.py: a hang guard, not a verdict on speed

from lmtrain.checkpoint.async_checkpoint import BackgroundSave, Stager


def test_staged_state_is_a_copy_that_training_cannot_change():
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    state = {"state_dict": OrderedDict(w=w), "optimizer_states": [{"state": {0: {"exp_avg": w * 2}}}],
             "loops": {"step": 7}, "hparams": defaultdict(int, lr=3)}
    staged = Stager().stage(state)
    w.add_(100)  # the next optimizer step, while the writer still writes
    state["loops"]["step"] = 8
    assert torch.equal(staged["state_dict"]["w"], torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert torch.equal(staged["optimizer_states"][0]["state"][0]["exp_avg"], torch.arange(6.0).reshape(2, 3) * 2)
    assert staged["loops"] == {"step": 7}
    assert isinstance(staged["state_dict"], OrderedDict) and isinstance(staged["hparams"], defaultdict)
    assert staged["hparams"]["missing"] == 0 and staged["hparams"]["lr"] == 3


def test_buffers_are_reused_between_saves_and_tied_tensors_stay_tied():
    stager = Stager()
    emb = torch.randn(4, 3)
    first = stager.stage({"wte": emb, "lm_head": emb, "b": torch.zeros(3)})
    assert first["wte"] is first["lm_head"]  # tied weights: staged once, saved once
    assert stager.bytes == (12 + 3) * 4
    emb.mul_(2)
    second = stager.stage({"wte": emb, "lm_head": emb, "b": torch.zeros(3)})
    assert second["wte"].data_ptr() == first["wte"].data_ptr()  # the same host buffer, refilled
    assert torch.equal(second["wte"], emb)
    third = stager.stage({"wte": torch.randn(5, 3), "lm_head": emb, "b": torch.zeros(3)})  # a shape changed
    assert third["wte"].shape == (5, 3) and stager.bytes == (15 + 12 + 3) * 4


def test_reserved_buffers_are_the_ones_the_first_staging_copies_into():
    """Stager.reserve (the attempt's first step boundary, on a thread): every buffer the staging of
    the same layout needs exists before it, tied tensors reserved once, nothing copied; the first
    real staging allocates nothing more and fills exactly those buffers."""
    emb = torch.randn(4, 3)
    state = {"state_dict": OrderedDict(wte=emb, lm_head=emb, b=torch.ones(3)),
             "optimizer_states": [{"state": {0: {"exp_avg": torch.full((4, 3), 2.0)}}}], "loops": {"step": 1}}
    stager = Stager()
    assert stager.reserve(state) == (12 + 3 + 12) * 4
    reserved = {k: (b.data_ptr(), b.shape) for k, b in stager._buffers.items()}
    assert sorted(reserved) == ["/optimizer_states/0/state/0/exp_avg", "/state_dict/b", "/state_dict/wte"]
    assert all(float(b.abs().sum()) == 0 for b in stager._buffers.values())  # touched, nothing copied
    emb.add_(1)  # training went on after the reservation
    staged = stager.stage(state)
    assert {k: (b.data_ptr(), b.shape) for k, b in stager._buffers.items()} == reserved and stager.bytes == 27 * 4
    assert staged["state_dict"]["wte"] is staged["state_dict"]["lm_head"]
    assert staged["state_dict"]["wte"].data_ptr() == reserved["/state_dict/wte"][0] and torch.equal(staged["state_dict"]["wte"], emb)
    assert staged["loops"] == {"step": 1}


def test_one_save_in_flight_and_its_error_surfaces_on_the_training_thread():
    saves = BackgroundSave()
    release = threading.Event()
    order = []
    saves.start(4, lambda: (release.wait(HANG_S), order.append(4)))
    assert saves.in_flight
    release.set()
    saves.start(8, lambda: order.append(8))  # waits for step 4's write first
    saves.wait()
    assert order == [4, 8] and not saves.in_flight

    def fail():
        raise OSError(28, "No space left on device")

    saves.start(12, fail)
    with pytest.raises(RuntimeError, match=r"background save of checkpoint step-12 failed: OSError: .*No space left"):
        saves.wait()
    assert saves.wait() == 0.0  # reported once
