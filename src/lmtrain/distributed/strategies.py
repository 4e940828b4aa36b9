"""The Lightning strategy of a plan: DDP, FSDP2 or DeepSpeed ZeRO 1/2/3, on GPUs and on CPUs.

One owner for "which strategy object runs this plan", so that the plan's ``trainer.strategy``
and ``deepspeed.json`` are exactly what the Trainer gets:

- ``ddp``: Lightning's DDPStrategy (NCCL on GPUs, gloo on CPUs); on one process, Lightning's
  SingleDeviceStrategy: no data-parallel wrapper around the model (a compiled model stays one
  graph: DDP's optimizer would split it at every bucket, pytorch#108966), nothing to reduce, the
  same checkpoint (the module's own state dict either way, so a run resumes on any world size).
- ``fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard``) through Lightning's
  ModelParallelStrategy, whose device mesh is (data_parallel, tensor_parallel): with
  ``trainer.tensor_parallel_size`` 1 the data dimension is the whole world;
  :meth:`lmtrain.model.module.LMModule.configure_model` splits each block over the tensor dimension
  (lmtrain.model.tensor_parallel), then shards each transformer block and the root over the data one. FSDP1 refuses CPUs in torch itself ("FSDP needs a non-CPU accelerator
  device"); FSDP2 runs on both. Checkpoints are torch.distributed.checkpoint (DCP) directories,
  one shard file per rank, which DCP reshards when the world size changes.
- ``deepspeed``: Lightning's DeepSpeedStrategy initialised with the plan's DeepSpeed config key
  for key. On CPUs (``DS_ACCELERATOR=cpu``, gloo) three CUDA-only assumptions of Lightning's
  strategy are overridden in :class:`CPUDeepSpeedStrategy` (verified with lightning 2.6,
  deepspeed 0.19: ZeRO 1, 2 and 3 train, save their sharded checkpoint and resume).
  Both DeepSpeed strategies start the engine with DeepSpeed's Muon kernels compiled on first
  use (:func:`import_muon_compiled_on_first_use`): lmtrain's optimizer is AdamW, and compiling
  them at import cost every rank of every attempt 1.5 s of CPU.
"""

from __future__ import annotations

import functools
import importlib
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    ModelParallelStrategy,
    ParallelStrategy,
    SingleDeviceStrategy,
)

from lmtrain.checkpoint.writeback import save_streamed
from lmtrain.distributed.task_env import cluster_environment, process_group_timeout


class DirectCheckpointIO(TorchCheckpointIO):
    """``torch.save`` straight into the file lmtrain's checkpoint protocol names (inside
    ``.step-S.tmp``, made atomic and durable by lmtrain.checkpoint.manager: fsync, rename, COMPLETE).

    Lightning's default first serialises the whole checkpoint into a BytesIO, then writes it
    through an fsspec transaction into a temporary file in the system temp directory and moves
    that into place: twice the checkpoint in host memory, a node-local /tmp that must hold all of
    it, and a second full copy when /tmp is another filesystem."""

    def __init__(self, source: Any = None) -> None:
        super().__init__()
        self.source = source  # lmtrain.checkpoint.cross_format.Source: a checkpoint of another format

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        if self.source is not None and Path(path).is_dir():  # FSDP2's, TP's, stages' or ZeRO's files
            return self.source.ddp_checkpoint(Path(path))
        return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("lmtrain's checkpoint IO takes no storage_options")
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        # No CRC32 per record: torch.load never checks it, and computing it costs a pass over
        # every byte (0.3 s of the 1.5 GB GPT-2 124M checkpoint on this machine's CPU). The
        # checkpoint's integrity is lmtrain's COMPLETE manifest and its fsync-then-rename protocol.
        torch.serialization.set_crc32_options(False)
        with open(target, "wb") as f:
            save_streamed(checkpoint, f)  # the disk writes while torch serialises


MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"


def import_muon_compiled_on_first_use() -> None:
    """Import DeepSpeed's Muon optimizer with its kernels compiled when first called, not at import.

    Every ZeRO engine imports that module as it starts (to test the client optimizer against
    Muon), and the module wraps three kernels in ``torch.compile`` at import, which loads torch's
    inductor: 1.5 s of CPU on each rank of every attempt, for an optimizer lmtrain never builds
    (its optimizer is AdamW). Imported here first, with DeepSpeed's ``compiler.compile`` giving a
    wrapper that calls ``torch.compile`` on the first call, the module is the same to every later
    import and no kernel is compiled unless one runs. Nothing else is changed: DeepSpeed's
    ``compile`` is put back. A process that already imported the module keeps it."""
    if MUON_MODULE in sys.modules:
        return
    from deepspeed.runtime import compiler

    at_import = compiler.compile
    compiler.compile = _compiled_on_first_call
    try:
        importlib.import_module(MUON_MODULE)
    finally:
        compiler.compile = at_import


def _compiled_on_first_call() -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        compiled: Callable[..., Any] | None = None

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                compiled = torch.compile(fn)
            return compiled(*args, **kwargs)

        return call

    return decorate


class LmDeepSpeedStrategy(DeepSpeedStrategy):
    """Lightning's DeepSpeedStrategy whose engine starts without compiling Muon's kernels, and
    whose ZeRO optimizer steps without host syncs (:mod:`lmtrain.distributed.zero_syncs`)."""

    def init_deepspeed(self) -> None:
        from lmtrain.distributed.zero_syncs import without_host_syncs

        import_muon_compiled_on_first_use()
        super().init_deepspeed()
        without_host_syncs(getattr(self.model, "optimizer", None))


class CPUDeepSpeedStrategy(LmDeepSpeedStrategy):
    """DeepSpeedStrategy on CPU processes (DeepSpeed's CPU accelerator, gloo).

    Lightning's strategy assumes CUDA in three places; each override replaces one of them:

    - ``setup_environment`` refuses any accelerator but CUDA: skip the check, run DDP's setup.
    - ``setup_distributed`` validates device indices, which CPU devices do not have ([None,
      None]): skip that, do the rest (seed, ranks, ``deepspeed.init_distributed``).
    - ``root_device`` is ``cpu`` without an index, and DeepSpeed needs an integer device rank:
      ``cpu:<local rank>`` (CPU tensors ignore the index).
    """

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)  # Strategy.setup_environment + self.setup_distributed()

    def setup_distributed(self) -> None:
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    @property
    def root_device(self) -> torch.device:
        return torch.device("cpu", self.local_rank)


def _use_deepspeed_cpu_accelerator() -> None:
    """DeepSpeed picks its accelerator once per process (DS_ACCELERATOR, else detection); the plan
    exports DS_ACCELERATOR=cpu to CPU jobs, and a process started otherwise (a benchmark, a
    notebook) gets it here, before DeepSpeed's first look. A process where DeepSpeed already
    chose another accelerator cannot run a CPU job: say so."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.accelerator import get_accelerator

    name = get_accelerator().device_name()
    if os.environ["DS_ACCELERATOR"] != "cpu" or name != "cpu":
        raise RuntimeError(
            f"this CPU job needs DeepSpeed's CPU accelerator, but DS_ACCELERATOR is "
            f"{os.environ['DS_ACCELERATOR']!r} and DeepSpeed chose {name!r}"
        )


def deepspeed_config_for_lightning(plan: Any) -> dict[str, Any]:
    """The plan's DeepSpeed config as Lightning takes it: Lightning sets gradient accumulation
    from the Trainer (and refuses it in the config), and puts it back in the engine's config."""
    want = plan.trainer.accumulate_grad_batches
    config = dict(plan.deepspeed or {})
    accum = config.pop("gradient_accumulation_steps", want)
    if accum != want:
        raise RuntimeError(
            f"plan inconsistency: deepspeed gradient_accumulation_steps({accum}) != "
            f"trainer accumulate_grad_batches({want})"
        )
    return config


class LmModelParallelStrategy(ModelParallelStrategy):
    """Lightning's ModelParallelStrategy (FSDP2, tensor parallelism, DCP checkpoints) whose
    optimizer state is flattened by parameter name (``flatten_optimizer_state_dict``, as
    torchtitan saves it): each rank's param groups are keyed by its own parameters' names, so that
    ranks holding different parameters (pipeline stages) do not overwrite each other's groups in
    the checkpoint, and every layout reads every other's. Checkpoints written before (nested param
    groups) are read in their own form."""

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        from lightning.pytorch.core.optimizer import LightningOptimizer
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        options = StateDictOptions(cpu_offload=True, flatten_optimizer_state_dict=True)
        assert self.model is not None
        return get_optimizer_state_dict(self.model, optimizer, options=options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        from lightning.fabric.strategies.model_parallel import _METADATA_FILENAME, _distributed_checkpoint_load
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        path = Path(self.broadcast(checkpoint_path))
        source = getattr(self, "source", None)
        if source is not None:  # DDP's file or ZeRO's directory: lmtrain.checkpoint.cross_format
            return self._load_portable(source.portable(path))
        keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata.keys()
        # nested param groups (written before) are numbered: optimizer_0.param_groups.0.lr; flattened
        # ones are keyed by parameter name: optimizer_0.param_groups.model.model.layers.0....lr
        flat = not any(re.match(r"optimizer_\d+\.param_groups\.\d+\.", k) for k in keys)
        options = StateDictOptions(cpu_offload=True, flatten_optimizer_state_dict=flat)
        module = self.model
        assert module is not None and self.lightning_module is not None
        state = {"state_dict": get_model_state_dict(module)}
        _distributed_checkpoint_load(state, path)
        module.load_state_dict(state["state_dict"], strict=self.lightning_module.strict_loading)
        for i, optimizer in enumerate(self.optimizers):
            part = {f"optimizer_{i}": get_optimizer_state_dict(module, optimizer, options=options)}
            _distributed_checkpoint_load(part, path)
            set_optimizer_state_dict(module, optimizer, optim_state_dict=part[f"optimizer_{i}"], options=options)
        return torch.load(path / _METADATA_FILENAME, weights_only=weights_only)


    def _load_portable(self, portable: Any) -> dict[str, Any]:
        """Every rank takes its own part (its shards, its stages' parameters) of the whole state."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        module = self.model
        assert module is not None
        mine = set(module.state_dict())
        missing = sorted(mine - set(portable.model))
        if missing:
            raise RuntimeError(f"the checkpoint holds no weights for {missing[:5]}")
        set_model_state_dict(module, {k: v for k, v in portable.model.items() if k in mine},
                             options=StateDictOptions(full_state_dict=True))
        from lmtrain.checkpoint.cross_format import fill

        options = StateDictOptions(flatten_optimizer_state_dict=True)
        for optimizer in self.optimizers:  # this rank's state, by name, each entry cut from the whole one
            mine = get_optimizer_state_dict(module, optimizer, options=options)
            set_optimizer_state_dict(module, optimizer, optim_state_dict=fill(mine, portable.optimizer), options=options)
        return portable.lightning


class PipelineStrategy(LmModelParallelStrategy):
    """Lightning's ModelParallelStrategy (FSDP2, DCP checkpoints, the module's configure_model)
    on a 3D device mesh ``(data_parallel, pipeline, tensor_parallel)``, tensor innermost: the
    module splits its model into stages over the ``pipeline`` dimension (lmtrain.model.pipeline)
    and FSDP2 shards each stage over ``data_parallel``."""

    def __init__(self, data_parallel: int, pipeline: int, tensor: int, **kwargs: Any) -> None:
        super().__init__(data_parallel_size=data_parallel * pipeline, tensor_parallel_size=tensor, **kwargs)
        self._mesh_shape = (data_parallel, pipeline, tensor)

    def setup_environment(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        ParallelStrategy.setup_environment(self)  # the accelerator, as Lightning's does
        self._setup_distributed()
        if int(torch.tensor(self._mesh_shape).prod()) != self.world_size:
            raise RuntimeError(f"mesh {self._mesh_shape} does not make world_size({self.world_size})")
        self._device_mesh = init_device_mesh(self.root_device.type, self._mesh_shape,
                                             mesh_dim_names=("data_parallel", "pipeline", "tensor_parallel"))
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh


def _cuda_index(env: Any) -> int:
    """This rank's CUDA device: cuda:0 when SLURM bound it to one GPU (it sees only that one), else
    the one at its local rank (lmtrain.distributed.gpu_binding)."""
    from lmtrain.distributed.gpu_binding import cuda_index, cuda_visible

    return cuda_index(cuda_visible(os.environ), env.local_rank)


def bound_devices(strategy: Any, trainer_kwargs: dict[str, Any], plan: Any, env: Any) -> dict[str, Any]:
    """The Trainer's arguments for a rank SLURM bound to one GPU of its own (``--gpu-bind=per_task:1``):
    it sees one device, so Lightning is given that one (``devices=1``) and the node's ranks as the
    strategy's devices, each ``cuda:0`` (a rank's device is ``parallel_devices[local_rank]``, and
    ``devices=N`` would ask CUDA for N it cannot see). Unchanged otherwise (the rank sees the
    node's GPUs and takes the one at its local rank, as Lightning does)."""
    per_node = plan.topology.tasks_per_node
    if plan.trainer.accelerator != "gpu" or per_node == 1 or not hasattr(strategy, "parallel_devices"):
        return trainer_kwargs
    from lmtrain.distributed.gpu_binding import cuda_visible

    if len(cuda_visible(os.environ)) != 1:
        return trainer_kwargs
    strategy.parallel_devices = [torch.device("cuda", 0)] * per_node
    return {**trainer_kwargs, "devices": 1}


def build_strategy(plan: Any, env: Any, *, load_universal: bool = False, source: Any = None) -> Any:
    """The Lightning strategy object for the plan, with lmtrain's cluster environment and the
    spec's collective timeout. ``load_universal``: the DeepSpeed engine resumes a universal
    checkpoint (lmtrain.checkpoint.elastic; the one key added to the plan's DeepSpeed config).
    ``source``: the checkpoint resumed is another format's (lmtrain.checkpoint.cross_format)."""
    strategy = _strategy(plan, env, load_universal)
    if source is not None:
        if isinstance(strategy, LmModelParallelStrategy):
            strategy.source = source
        elif isinstance(getattr(strategy, "checkpoint_io", None), DirectCheckpointIO):
            strategy.checkpoint_io.source = source
        else:
            raise RuntimeError(f"{type(strategy).__name__} does not load a checkpoint of another strategy")
    return strategy


def _strategy(plan: Any, env: Any, load_universal: bool) -> Any:
    cluster = cluster_environment(env)
    backend = plan.training.process_group_backend
    timeout = process_group_timeout(plan)  # every collective: spec watchdog.collective_timeout_s
    par = plan.parallelism
    if par.replicated and env.world_size == 1:
        device = torch.device("cuda", _cuda_index(env)) if plan.trainer.accelerator == "gpu" else torch.device("cpu")
        return SingleDeviceStrategy(device=device, checkpoint_io=DirectCheckpointIO())
    if par.replicated:
        return DDPStrategy(
            cluster_environment=cluster,
            timeout=timeout,
            process_group_backend=backend,
            gradient_as_bucket_view=True,  # grads live in the buckets: no extra copy
            find_unused_parameters=False,
            # a causal LM's buffers (rotary frequencies, masks) are built alike on every rank and never
            # change: no broadcast from rank 0 at every forward, where a rank late from its loader would
            # make the others wait (and their forward time, lmtrain.observe.rank_timing, look slow)
            broadcast_buffers=False,
            checkpoint_io=DirectCheckpointIO(),  # DeepSpeed and FSDP2 (DCP) write their files directly already
        )
    if par.fsdp and par.pipeline > 1:
        strategy = PipelineStrategy(par.data_parallel_size, par.pipeline, par.tensor,
                                    save_distributed_checkpoint=True, process_group_backend=backend, timeout=timeout)
        strategy.cluster_environment = cluster
        return strategy
    if par.fsdp:
        strategy = LmModelParallelStrategy(  # the (data_parallel, tensor_parallel) device mesh
            data_parallel_size=par.data_parallel_size,
            tensor_parallel_size=par.tensor,
            save_distributed_checkpoint=True,  # every rank writes its own shard (DCP): no gather
            process_group_backend=backend,
            timeout=timeout,
        )
        strategy.cluster_environment = cluster
        return strategy
    if par.zero:
        from lmtrain.distributed.jit_ops import use_own_extensions_dir

        use_own_extensions_dir()  # DeepSpeed's JIT ops from this environment's own folder, built ahead
        config = deepspeed_config_for_lightning(plan)
        if load_universal:
            config["checkpoint"] = {**config.get("checkpoint", {}), "load_universal": True}
        if plan.trainer.accelerator == "cpu":
            _use_deepspeed_cpu_accelerator()
            return CPUDeepSpeedStrategy(
                config=config, cluster_environment=cluster, process_group_backend=backend, timeout=timeout
            )
        return LmDeepSpeedStrategy(
            config=config, cluster_environment=cluster, process_group_backend=backend, timeout=timeout
        )
    raise RuntimeError(f"no Lightning strategy builds {par.describe()}")


def trainer_plugins(strategy: Any, env: Any) -> list[Any]:
    """What the Trainer needs beside ``strategy``: a strategy of one process carries no cluster
    environment, and without lmtrain's the Trainer would detect SLURM itself and install
    Lightning's auto-requeue signal handlers (lmtrain owns the signals: lmtrain.preemption)."""
    return [] if isinstance(strategy, ParallelStrategy) else [cluster_environment(env)]
