"""model.pretrained loads a local directory, offline (local_files_only), with its weights."""

import torch

from lmtrain.model.causal_lm import build_model


def test_pretrained_local_dir_loads_the_saved_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = {"type": "gpt2", "config": {"n_layer": 1, "n_head": 2, "n_embd": 16, "n_positions": 16, "vocab_size": 50}}
    original = build_model(spec, seed=3)
    original.save_pretrained(tmp_path / "m")
    loaded = build_model({"pretrained": str(tmp_path / "m"), "config": {}}, seed=99)
    a, b = original.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
