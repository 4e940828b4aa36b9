"""The data a run reads, checked before queue time against the model and this machine (the
runtime's own checks, made early): each prepared store's index (meta.json) against the model's
vocabulary, its document separator and a mixture's other stores; the store's path (a prepared
store, not a raw file; missing only where it cannot be seen from here, or is made by an earlier
job); the sequence length against the model's positions. Each answer is (problems, notes):
problems refuse the spec, notes are said."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lmcore.job.plan import LaunchPlan
from lmcore.job.spec import DataSource, JobSpec
from lmcore.run.token_meta import read_index, tokenized_with, tokenizer_identity

StoreIndex = tuple[str, DataSource, "dict[str, Any] | None"]  # (spec key, the store, its meta.json when readable here)


def store_indexes(spec: JobSpec) -> list[StoreIndex]:
    """Each store the run reads (data.path, or data.sources), with its index where it is readable
    here (the nodes may see other paths): read once for the plan's notes and checks."""
    keys = ["data.path"] if spec.data.sources is None else [f"data.sources[{i}]" for i in range(len(spec.data.sources))]
    return [(key, store, read_index(store.path)[0]) for key, store in zip(keys, spec.data.stores)]


def mixture_notes(spec: JobSpec, plan: LaunchPlan, stores: list[StoreIndex]) -> list[str]:
    """For ``data.sources``: how many epochs of each store the run takes (its weight's share of the
    tokens the run trains on), where its index is readable here."""
    if spec.data.sources is None:
        return []
    needed = plan.trainer.max_steps * plan.topology.global_batch_size * spec.data.seq_len
    total = sum(s.weight for s in spec.data.sources)
    out = []
    for _, src, meta in stores:
        share = round(needed * src.weight / total)
        try:
            tokens = int(meta["num_tokens"])  # type: ignore[index]
        except (KeyError, TypeError, ValueError):
            out.append(f"data.sources {src.path}: weight {src.weight / total:.0%}, {share:,} tokens trained "
                       "(its index is not readable here: epochs unknown)")
            continue
        out.append(f"data.sources {src.path}: weight {src.weight / total:.0%}, {share:,} tokens trained of its "
                   f"{tokens:,}: {share / max(tokens, 1):.2f} epochs" + (" (repeated)" if share > tokens else ""))
    return out


def data_vocab_checks(stores: list[StoreIndex], model_vocab: int,
                      model_eos: tuple[int, ...] | None = None) -> tuple[list[str], list[str]]:
    """(problems, notes): each store whose index is readable here, against the model's vocabulary
    and (a mixture) the first store's tokenizer (the runtime's lmtrain.data.loader.check_same_tokens,
    before queue time). A store tokenized with more ids than the model's embedding holds is a
    problem (the runtime would stop on it); fewer is a note (rows never trained), and so is a
    store whose documents end with an id other than the model's ``eos_token_id`` (``model_eos``;
    None: not known). A store not readable here is the runtime's to check, on the nodes."""
    problems, notes = [], []
    first: tuple[str, dict[str, Any]] | None = None
    for key, store, meta in stores:
        try:
            vocab, kind = int(meta["vocab_size"]), tokenizer_identity(meta)[2] or "?"  # type: ignore[index, arg-type]
        except (KeyError, TypeError, ValueError):
            continue
        assert meta is not None
        if first is None:
            first = (f"{key} {store.path}", meta)
            notes += _eos_notes(key, store.path, meta.get("eos_id"), model_eos)
        elif tokenizer_identity(meta) != tokenizer_identity(first[1]):
            problems.append(f"{key} {store.path}: tokenized with {tokenized_with(meta)}, but {first[0]} with "
                            f"{tokenized_with(first[1])}: the stores of a mixture must share one tokenizer")
        if vocab > model_vocab:
            problems.append(f"{key} {store.path}: tokenized with vocab_size {vocab} ({kind} tokenizer), but the model "
                            f"has vocab_size {model_vocab}: ids >= {model_vocab} would index past its embedding; set "
                            f"model.config.vocab_size: {vocab}, or use data tokenized for this model")
        elif vocab < model_vocab:
            notes.append(f"{key} {store.path}: tokenized with vocab_size {vocab} ({kind} tokenizer), the model has "
                         f"{model_vocab}: {model_vocab - vocab:,} rows of its embedding are never trained")
    return problems, notes


def _eos_notes(key: str, path: str, eos: Any, model_eos: tuple[int, ...] | None) -> list[str]:
    """The store's document separator against the model's eos_token_id (one note at most)."""
    if model_eos is None or not isinstance(eos, int) or eos in model_eos:
        return []
    has = (f"eos_token_id {model_eos[0]}" if len(model_eos) == 1 else f"eos_token_id {list(model_eos)}") \
        if model_eos else "no eos_token_id"
    return [f"{key} {path}: its documents end with id {eos} (the tokenizer's eos), but the model has {has}: "
            f"it learns to end a document with an id its generation does not stop at; set "
            f"model.config.eos_token_id: {eos}"]


RAW_SUFFIXES = (".jsonl", ".json", ".txt", ".parquet", ".gz", ".zst", ".arrow", ".csv")


def store_path_checks(stores: list[StoreIndex], *, seen_here: bool, later: bool) -> tuple[list[str], list[str]]:
    """Each store's path: a prepared store (a directory with its meta.json), never a raw file.
    A path missing here is a problem when this machine sees the filesystem it would be on
    (``seen_here``: SLURM is reached from here, not over SSH or slurmrestd; and the path's top
    directory, e.g. /shared, exists here) and no earlier job makes it (``later``: a pipeline stage
    or ``--after`` may prepare it); else a note."""
    problems, notes = [], []
    for key, store, meta in stores:
        if meta is not None:
            continue
        path = Path(store.path)
        prepare = f"`lmlaunch data prepare INPUT... --out {store.path}`"
        if path.is_file():
            kind = "a raw text file" if path.name.endswith(RAW_SUFFIXES) else "a file"
            problems.append(f"{key} {store.path}: {kind}, not a prepared store (a directory with meta.json); "
                            f"tokenize it first: `lmlaunch data prepare {store.path} --out DIR`, then set {key}: DIR")
            continue
        why = read_index(path)[1] or "not readable"
        if path.is_dir() and not later:
            problems.append(f"{key} {store.path}: {why}; make it with {prepare}")
        elif not path.exists() and seen_here and not later and _top_exists(path):
            problems.append(f"{key} {store.path}: no such directory here; make it with {prepare} (a path only the "
                            "nodes see: prepare it there with `lmlaunch data prepare ... --on-cluster`, and submit "
                            "with --after that run)")
        else:
            where = "made by the job this one runs after" if later else "its filesystem is not visible from here"
            notes.append(f"{key} {store.path}: not checked ({where}); the run stops at its start if it is not a "
                         "prepared store")
    return problems, notes


def _top_exists(path: Path) -> bool:
    """Whether the directory at the top of ``path`` (``/shared`` of /shared/data/x) exists here: a
    path on a filesystem this machine does not mount is the nodes' to see."""
    parts = path.absolute().parts
    return len(parts) < 2 or Path(parts[0], parts[1]).is_dir()


def position_checks(seq_len: int, positions: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """``data.seq_len`` against the model's positions (lmtrain.model.memory_facts.positions): longer
    than a learned position table is a problem (the first forward indexes past it); longer than the
    configured maximum of rotary or ALiBi positions is a note (it runs; the model was not set up for it)."""
    learned, configured, key = positions.get("learned"), positions.get("configured"), positions.get("key")
    setting = f"model.config.{key}" if key else "the model's position table"
    if isinstance(learned, int) and seq_len > learned:
        return [f"data.seq_len {seq_len} is longer than the model's {learned} learned positions ({setting}: "
                f"{configured if configured is not None else learned}): the first step would index past its position "
                f"table; set data.seq_len: {learned} or less, or {setting}: {seq_len} or more"], []
    if learned is None and isinstance(configured, int) and seq_len > configured:
        return [], [f"data.seq_len {seq_len} is longer than {setting} ({configured}): the model's positions are "
                    "computed (rotary or ALiBi), so it runs, but the config says it was not made for sequences this "
                    f"long; set {setting}: {seq_len} to say it is"]
    return [], []
