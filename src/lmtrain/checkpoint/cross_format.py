"""Resuming a checkpoint written in another strategy's format: a run checkpointed under DDP
continues under FSDP2, tensor or pipeline parallelism, and the reverse, and a ZeRO run continues
under any of them, with its weights, AdamW's moments and step, the learning-rate schedule, the
loops and the data position (the ranks' own files, read as for any other world size).

Each format is read into one portable form, the checkpoint as one process holds it: the
LightningModule's full state dict, the optimizer state flattened by parameter name as
``torch.distributed.checkpoint.state_dict`` writes it (``state.<name>.exp_avg``,
``param_groups.<name>.lr``: what every layout of lmtrain's DCP checkpoints holds already), and
Lightning's own entries (loops, callbacks, schedulers, step). The target's strategy loads it:

- DDP (``lightning.ckpt``, one file): the optimizer state numbered as DDP's optimizer numbers its
  parameters (lmtrain.model.module.param_groups over the model the spec builds: the decayed matrices,
  then the rest, in the model's order);
- torch.distributed.checkpoint (FSDP2, TP, pipeline stages): the flattened state as it is;
- DeepSpeed ZeRO: its universal form (lmtrain.checkpoint.elastic makes it before the rendezvous),
  one directory per parameter with its fp32 weight and moments, the groups' settings from the
  ZeRO optimizer file and Lightning's entries from the model-states file.

Loading into ZeRO from another format is not offered (DeepSpeed reads its own partitions or its
universal form only): validate and the runtime refuse it, naming the ways that work.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

LIGHTNING_KEYS = ("epoch", "global_step", "pytorch-lightning_version", "loops", "callbacks", "lr_schedulers")
MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class Portable:
    """A checkpoint as one process holds it, whatever wrote it."""

    model: dict[str, torch.Tensor]  # the LightningModule's keys: model.model.layers.0...
    optimizer: dict[str, Any]  # flattened by name: state.<name>.exp_avg, param_groups.<name>.lr
    lightning: dict[str, Any]  # epoch, global_step, loops, callbacks, lr_schedulers, version


def format_of(path: Path) -> str:
    """``full`` (one file: DDP), ``zero`` (DeepSpeed's directory) or ``dcp``."""
    if path.is_file():
        return "full"
    return "zero" if (path / "latest").exists() else "dcp"


def name_order(model_spec: Any) -> list[str]:
    """The LightningModule's parameter names in the order DDP's AdamW numbers them."""
    from lmtrain.model.causal_lm import meta_model
    from lmtrain.model.module import param_groups

    model = meta_model(model_spec)
    names = {id(p): f"model.{n}" for n, p in model.named_parameters()}
    return [names[id(p)] for group in param_groups(model, 0.0) for p in group["params"]]


def shapes_of(model_spec: Any) -> dict[str, torch.Size]:
    """The LightningModule's parameter shapes (ZeRO-3's universal files hold them flattened)."""
    from lmtrain.model.causal_lm import meta_model

    return {f"model.{n}": p.shape for n, p in meta_model(model_spec).named_parameters()}


def read(path: Path, model_spec: Any, universal: Path | None = None) -> Portable:
    """The checkpoint at ``path`` (a step's ``lightning.ckpt``) in portable form; ``model_spec``:
    the model whose parameters DDP numbers and whose shapes ZeRO-3 flattened; ``universal``: a
    ZeRO checkpoint's universal form."""
    kind = format_of(path)
    if kind == "full":
        return _from_full(path, name_order(model_spec))
    if kind == "dcp":
        return _from_dcp(path)
    if universal is None:
        raise RuntimeError(f"{path}: a ZeRO checkpoint is read in its universal form, and none was made")
    return _from_zero(path, universal, shapes_of(model_spec))


def _from_full(path: Path, names: list[str]) -> Portable:
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    opt = ckpt["optimizer_states"][0]
    flat: dict[str, Any] = {}
    for group in opt["param_groups"]:
        for index in group["params"]:
            name = names[index]
            for key, value in opt["state"].get(index, {}).items():
                flat[f"state.{name}.{key}"] = value
            flat.update({f"param_groups.{name}.{k}": v for k, v in group.items() if k != "params"})
    return Portable(ckpt["state_dict"], flat, {k: ckpt[k] for k in LIGHTNING_KEYS if k in ckpt})


def _from_dcp(path: Path) -> Portable:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from lmtrain.checkpoint.weights import lightning_state_dict

    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=FileSystemReader(str(path)),
                     planner=_EmptyStateDictLoadPlanner(keys={"optimizer_0"}), no_dist=True)
    flat = state["optimizer_0"]
    if any(k.startswith("param_groups.") and k.split(".")[1].isdigit() for k in flat):
        raise RuntimeError(f"{path}: its optimizer state is in the nested form of an older lmtrain; resume it "
                           "with its own strategy once, then with another")
    meta = torch.load(path / "meta.pt", map_location="cpu", weights_only=True)
    return Portable(lightning_state_dict(path), dict(flat), {k: meta[k] for k in LIGHTNING_KEYS if k in meta})


def _from_zero(path: Path, universal: Path, shapes: dict[str, torch.Size]) -> Portable:
    tag = (universal / "latest_universal").read_text().strip()
    root = universal / tag
    states = torch.load(next(root.glob("*mp_rank_00_model_states.pt")), map_location="cpu", weights_only=False)
    opt = torch.load(next((path / tag).glob("*optim_states.pt")), map_location="cpu", weights_only=False)
    zero = opt["optimizer_state_dict"]  # ZeRO-3 keeps the torch optimizer's under its own name, 1 and 2 as the base's
    groups = (zero.get("optimizer_state_dict") or zero["base_optimizer_state"])["param_groups"]  # decay, none
    step = torch.tensor(float(states["global_steps"]))
    model: dict[str, torch.Tensor] = {}
    flat: dict[str, Any] = {}
    for folder in sorted((root / "zero").iterdir()):
        if not folder.is_dir():
            continue
        name = folder.name
        if name not in shapes:
            raise RuntimeError(f"{universal}: a parameter {name} that the spec's model does not have")
        model[name] = _tensor(folder / "fp32.pt").reshape(shapes[name])
        flat[f"state.{name}.step"] = step.clone()
        for key in MOMENTS:
            flat[f"state.{name}.{key}"] = _tensor(folder / f"{key}.pt").reshape(shapes[name])
        group = groups[0] if model[name].dim() >= 2 else groups[-1]
        flat.update({f"param_groups.{name}.{k}": v for k, v in group.items() if k != "params"})
    return Portable(model, flat, {k: states[k] for k in LIGHTNING_KEYS if k in states})


def _tensor(path: Path) -> torch.Tensor:
    got = torch.load(path, map_location="cpu", weights_only=False)
    return got["param"] if isinstance(got, dict) else got


def as_ddp(portable: Portable, names: list[str], state_keys: list[str]) -> dict[str, Any]:
    """A DDP checkpoint's dictionary of ``portable`` (Lightning loads it as its own file): the
    optimizer state numbered as DDP's optimizer numbers ``names``; ``state_keys``: the module's
    state dict keys (a tied head stored once by the source is its embedding again)."""
    model = dict(portable.model)
    lacking = sorted(set(state_keys) - set(model))
    if lacking:
        raise RuntimeError(f"the checkpoint holds no weights for {lacking[:5]}")
    state: dict[int, dict[str, Any]] = {}
    groups: dict[tuple, dict[str, Any]] = {}
    for index, name in enumerate(names):
        mine = {k.rsplit(".", 1)[1]: v for k, v in portable.optimizer.items() if k.rsplit(".", 1)[0] == f"state.{name}"}
        if mine:
            state[index] = mine
        settings = {k.rsplit(".", 1)[1]: v for k, v in portable.optimizer.items()
                    if k.rsplit(".", 1)[0] == f"param_groups.{name}"}
        same = tuple(sorted((k, str(v)) for k, v in settings.items()))  # one group per set of settings
        groups.setdefault(same, {**settings, "params": []})["params"].append(index)
    return {**portable.lightning, "state_dict": model,
            "optimizer_states": [{"state": state, "param_groups": list(groups.values())}]}


def tied_names(model_spec: Any) -> dict[str, str]:
    """Each second name of a tied parameter (a head tied to the input embedding: ``model.lm_head.weight``)
    and the name the model counts it under (``model.model.embed_tokens.weight``)."""
    from lmtrain.model.causal_lm import meta_model

    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, p in meta_model(model_spec).named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[f"model.{name}"] = f"model.{first[id(p)]}"
        else:
            first[id(p)] = name
    return out


def with_tied_names(portable: Portable, tied: dict[str, str]) -> Portable:
    """``portable`` with a tied weight's state under both its names: a strategy that counts the
    weight once (DDP, FSDP2) wrote one, a pipeline's last stage holds the head's copy under the other
    (its gradient summed with the embedding's, so its moments are the embedding's)."""
    model, optimizer = dict(portable.model), dict(portable.optimizer)
    for alias, name in tied.items():
        if alias not in model and name in model:
            model[alias] = model[name]
        for key, value in portable.optimizer.items():
            for kind in ("state.", "param_groups."):
                if key.startswith(f"{kind}{name}."):
                    optimizer.setdefault(f"{kind}{alias}.{key[len(kind) + len(name) + 1:]}", value)
    return Portable(model, optimizer, portable.lightning)


@dataclass(frozen=True)
class Source:
    """A checkpoint of another format, as the attempt's strategy loads it: ``model_spec`` (the
    model whose parameters DDP numbers), ``universal`` (a ZeRO checkpoint's universal form)."""

    model_spec: Any
    universal: Path | None = None

    def portable(self, path: Path) -> Portable:
        log.warning("reading %s (%s format) to resume it in another strategy's", path, format_of(path))
        return with_tied_names(read(path, self.model_spec, self.universal), tied_names(self.model_spec))

    def ddp_checkpoint(self, path: Path) -> dict[str, Any]:
        """What DDP's Lightning loads from its own file, made from ``path``."""
        from lmtrain.model.causal_lm import meta_model

        keys = [f"model.{k}" for k in meta_model(self.model_spec).state_dict()]
        return as_ddp(self.portable(path), name_order(self.model_spec), keys)


def converts(old: Any, new: Any) -> bool:
    """Whether a checkpoint written at Parallelism ``old`` is resumed at ``new`` through the
    portable form (another format, into one this module loads: not into ZeRO)."""
    return not new.same_format(old) and not new.zero


def fill(mine: dict[str, Any], whole: dict[str, Any]) -> dict[str, Any]:
    """This rank's optimizer state (flattened by name, its tensors sharded as its parameters are)
    with every entry taken from the whole state: a shard cut locally from the full tensor, a plain
    tensor or a setting as it is. A name the whole state lacks is an error naming it."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    lacking = sorted(k for k in mine if k not in whole)
    if lacking:
        raise RuntimeError(f"the checkpoint's optimizer state has no {lacking[:4]}")
    out: dict[str, Any] = {}
    for key, here in mine.items():
        value = whole[key]
        if isinstance(here, DTensor):
            out[key] = distribute_tensor(value.to(here.device, here.dtype), here.device_mesh, here.placements,
                                         src_data_rank=None)  # each rank cuts its own shard: no collective
        elif isinstance(here, torch.Tensor):
            out[key] = torch.as_tensor(value).to(here.device, here.dtype).reshape(here.shape)
        else:
            out[key] = value
    return out
