"""The GPU fast path's choices, checked where they are made (issue: at least the hand-written
loop's speed): model.compile compiles each transformer block (not the whole model, and keeps the
parameter names) and the loss (the same value and gradient as eager), and FSDP2 gathers in bf16 and reduces in fp32 under bf16-mixed, keeping the last
block gathered from its forward into its backward. Run in a child process: FSDP2 needs a process
group, which the test worker must not keep."""

from __future__ import annotations

import json
import subprocess
import sys

from waiting import HANG_S

CHILD = r"""
import json, os, sys
import torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
from torch.distributed.device_mesh import init_device_mesh
from lmtrain.model.causal_lm import build_model, compile_model, model_settings, transformer_blocks
from lmtrain.model.fsdp2 import shard_fsdp2

spec = {"type": "gpt2", "config": {"n_layer": 3, "n_embd": 32, "n_head": 2, "n_positions": 32, "vocab_size": 64,
                                   "eos_token_id": 0, "bos_token_id": 0}}
out = {}
for precision in ("bf16-mixed", "32-true"):
    model = build_model(model_settings(spec), seed=0)
    names = list(model.state_dict())
    compile_model(model)
    blocks = transformer_blocks(model)
    out["compiled_blocks"] = [b._compiled_call_impl is not None for b in blocks]
    out["compiled_root"] = model._compiled_call_impl is not None
    out["same_names"] = list(model.state_dict()) == names
    out["compiled_loss"] = hasattr(model.loss_function, "_torchdynamo_orig_callable")
    shard_fsdp2(model, init_device_mesh("cpu", (1,)), precision)
    groups = [b._get_fsdp_state()._fsdp_param_group for b in blocks]
    out[precision] = {
        "param_dtype": [str(g.mp_policy.param_dtype) for g in groups],
        "reduce_dtype": [str(g.mp_policy.reduce_dtype) for g in groups],
        "reshard_after_forward": [g.post_forward_mesh_info is not None for g in groups],
    }
# the compiled loss is the eager one: value and the logits' gradient, bf16 logits as autocast gives them
import torch
eager = build_model(model_settings(spec), seed=0).loss_function
logits = torch.randn(2, 8, 64, dtype=torch.bfloat16, requires_grad=True)
labels = torch.randint(0, 64, (2, 8))
labels[0, :3] = -100
got = []
for fn in (eager, model.loss_function):
    logits.grad = None
    loss = fn(logits, labels, vocab_size=64)
    loss.backward()
    got.append((loss.detach().float(), logits.grad.float()))
out["loss_diff"] = float((got[0][0] - got[1][0]).abs())
out["grad_diff"] = float((got[0][1] - got[1][1]).abs().max())
print(json.dumps(out))
dist.destroy_process_group()
"""


def test_compile_per_block_and_fsdp2_mixed_precision_with_the_last_block_kept_gathered():
    import socket

    from lmtrain.model.fsdp2 import reshards_after_forward

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "-c", CHILD, str(port)], capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["compiled_blocks"] == [True, True, True] and not got["compiled_root"] and got["same_names"]
    assert got["compiled_loss"] and got["loss_diff"] < 1e-5 and got["grad_diff"] < 1e-2, got
    # a one-rank mesh: every block stays gathered after its forward (freeing would save nothing)
    assert got["bf16-mixed"] == {"param_dtype": ["torch.bfloat16"] * 3, "reduce_dtype": ["torch.float32"] * 3,
                                 "reshard_after_forward": [False, False, False]}
    assert got["32-true"] == {"param_dtype": ["None"] * 3, "reduce_dtype": ["None"] * 3,
                              "reshard_after_forward": [False, False, False]}
    # on more ranks every block but the last is freed after its forward and gathered again for its backward
    assert [reshards_after_forward(i, 3, 2) for i in range(3)] == [True, True, False]
    assert [reshards_after_forward(i, 3, 1) for i in range(3)] == [False, False, False]
