"""The memory plan's inputs that only transformers can give (lmtrain.model.memory_facts: the parameters,
and the activations a training forward saves, traced with fake tensors), gathered in this
process and kept per model section, sequence length and versions of torch and transformers in
the user's cache (beside launcher.planning.model_check's answers): the first validate of a 7B model
traces for a few seconds, the next one reads a file. Traces for another precision or activation
checkpointing (what a fix would change) are made when first asked for.

Without the training stack (a CLI-only install) there is no estimate, and the plan says so."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from launcher.planning import runtime_stack
from launcher.planning.memory import ModelFacts
from launcher.planning.model_check import cache_dir
from lmcore.atomic import write_private
from lmcore.job.spec import JobSpec

FACTS_VERSION = 7  # bump when lmtrain.model.memory_facts counts differently: older files are not reused


class _Traces(Mapping[tuple[str, bool], tuple[int, int, int, int]]):
    """(compute, checkpointing) -> (saved, head at micro batch 1, saved, head at 2), traced when
    first read and written back to the cache file."""

    def __init__(self, spec: JobSpec, path: Path, known: dict[str, list[int]], gpu: bool) -> None:
        self.spec, self.path, self.known, self.gpu = spec, path, known, gpu
        self.kernels = "gpu" if gpu else "cpu"

    def __getitem__(self, key: tuple[str, bool]) -> tuple[int, int, int, int]:
        compute, ckpt = key
        name = f"{compute}|{int(ckpt)}|{self.kernels}"
        if name not in self.known:
            from lmtrain.model.memory_facts import activation_trace

            got = []
            with _quiet():
                for b in (1, 2):
                    t = activation_trace(self.spec.model, micro_batch=b, seq_len=self.spec.data.seq_len,
                                         compute=compute, checkpointing=ckpt, gpu_kernels=self.gpu)
                    got += [t["saved"], t["head"]]
            self.known[name] = got
            _save(self.path, {"traces": self.known})
        s1, h1, s2, h2 = self.known[name]
        return s1, h1, s2, h2

    def __iter__(self) -> Iterator[tuple[str, bool]]:
        return iter((k.split("|")[0], k.split("|")[1] == "1") for k in self.known if k.endswith(f"|{self.kernels}"))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, tuple) and len(key) == 2  # any mode can be traced


class _quiet:
    """transformers' own warnings about the config stay out of the CLI's output (model_check
    says what is wrong with a model section, once)."""

    def __enter__(self) -> None:
        from transformers.utils import logging as hf_logging

        self.level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        self.warnings = warnings.catch_warnings()
        self.warnings.__enter__()
        warnings.simplefilter("ignore")

    def __exit__(self, *exc: Any) -> None:
        from transformers.utils import logging as hf_logging

        self.warnings.__exit__(*exc)
        hf_logging.set_verbosity(self.level)


def unavailable(spec: JobSpec) -> str | None:
    """Why this install cannot estimate the job's memory (None when it can)."""
    lacking = runtime_stack.missing()
    if lacking is not None:
        return (f"memory not estimated here ({lacking} is not installed: {runtime_stack.INSTALL}); "
                f"`lmlaunch validate` where the training stack is installed shows it")
    if spec.model.pretrained is not None and not (Path(spec.model.pretrained) / "config.json").is_file():
        return f"memory not estimated here: {spec.model.pretrained}/config.json is not readable from this machine"
    return None


def model_facts(spec: JobSpec, environ: Mapping[str, str] | None = None, *, gpu: bool = False) -> ModelFacts:
    """The facts for ``spec`` (call :func:`unavailable` first); ``gpu``: activations as a GPU job's
    kernels save them (lmtrain.model.memory_facts)."""
    path = cache_dir(environ).parent / "memory-facts" / f"{_key(spec)}.json"
    data = _load(path)
    if data is None:
        from lmtrain.model.memory_facts import parameter_facts

        with _quiet():
            data = {**parameter_facts(spec.model), "traces": {}}
        _save(path, data)
    return ModelFacts(params=tuple(tuple(p) for p in data["params"]), blocks=int(data["blocks"]),  # type: ignore[misc]
                      tp_dims=tuple(int(d) for d in data.get("tp_dims") or ()),
                      vocab_size=int(data["vocab_size"]), seq_len=spec.data.seq_len,
                      eos_token_ids=tuple(int(i) for i in data.get("eos_token_ids") or ()),
                      tied_head=int(data.get("tied_head", -1)), positions=dict(data.get("positions") or {}),
                      traces=_Traces(spec, path, dict(data.get("traces") or {}), gpu))


def _key(spec: JobSpec) -> str:
    what = {"facts": FACTS_VERSION, "transformers": importlib.metadata.version("transformers"),
            "torch": importlib.metadata.version("torch"), "model": spec.model.model_dump(mode="json"),
            "seq_len": spec.data.seq_len}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]


def _load(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(data, dict) and isinstance(data.get("params"), list) and isinstance(data.get("blocks"), int)
    return data if ok else None


def _save(path: Path, update: dict[str, Any]) -> None:
    try:
        data = {**(_load(path) or {}), **update}
        path.parent.mkdir(parents=True, exist_ok=True)
        write_private(path, json.dumps(data) + "\n")
    except OSError:
        pass  # a cache only: the next command traces again
