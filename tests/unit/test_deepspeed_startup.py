"""A DeepSpeed engine starts without compiling DeepSpeed's Muon kernels: every ZeRO engine
imports its Muon optimizer as it starts, and that module's ``torch.compile`` decorators loaded
torch's inductor at import (1.5 s of CPU per rank, every attempt) for an optimizer lmtrain never
builds. The module is imported first with the kernels compiled on their first call."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = """
import json, sys
import torch
from deepspeed.runtime import compiler
at_import = compiler.compile
from lmtrain.distributed.strategies import MUON_MODULE, import_muon_compiled_on_first_use
import_muon_compiled_on_first_use()
from deepspeed.runtime.zero.muon import original_muon
from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS
kernel = original_muon.zeropower_via_newtonschulz5
print(json.dumps({
    "inductor": "torch._inductor.compile_fx" in sys.modules,
    "compile_restored": compiler.compile is at_import,
    "kernel_is_lazy": getattr(kernel, "__wrapped__", None) is not None and kernel.__name__ == "zeropower_via_newtonschulz5",
    "muon_class": MuonWithAuxAdam.__name__,
    "adamw_supported": torch.optim.AdamW in ZERO_SUPPORTED_OPTIMIZERS,
}))
"""


def test_muon_is_imported_without_loading_the_compiler_and_deepspeed_is_left_as_it_was():
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {
        "inductor": False, "compile_restored": True, "kernel_is_lazy": True, "muon_class": "MuonWithAuxAdam",
        "adamw_supported": True}
