"""A prepared store's index (``meta.json``, lmtrain.data.prepare.token_store) as the launcher reads it: the
standard library only, so validate and doctor look at stores without numpy or torch, and the
runtime compares the stores of a mixture by the same key."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def read_index(path: str | Path) -> tuple[dict[str, Any] | None, str | None]:
    """(the store's meta.json, None), or (None, why it cannot be read)."""
    meta = Path(path) / "meta.json"
    if not Path(path).is_dir():
        return None, "no such directory (make it with `lmlaunch data prepare ... --out DIR`)"
    try:
        d = json.loads(meta.read_text())
    except FileNotFoundError:
        return None, f"{meta} is missing: not a prepared data directory"
    except (OSError, ValueError) as exc:
        return None, f"{meta}: {exc}"
    return (d, None) if isinstance(d, dict) else (None, f"{meta}: not a JSON object")


def tokenizer_identity(meta: Mapping[str, Any]) -> tuple[Any, Any, Any, Any]:
    """What stores of one mixture must share: (vocab_size, eos_id, tokenizer kind, its class)."""
    tok = meta.get("tokenizer") or {}
    return meta.get("vocab_size"), meta.get("eos_id"), tok.get("kind"), tok.get("class")


def tokenized_with(meta: Mapping[str, Any]) -> str:
    """``huggingface (vocab_size 300, eos 0)``."""
    vocab, eos, kind, _ = tokenizer_identity(meta)
    return f"{kind} (vocab_size {vocab}, eos {eos})"
