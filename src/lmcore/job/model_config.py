"""Checks on ``model.config``: overrides of a transformers config, written as free-form YAML.

The launcher does not import transformers, so it cannot ask a config class which attributes
are integers. It knows the naming of transformers' count, size and id attributes instead
(``n_layer``, ``hidden_size``, ``num_attention_heads``, ``vocab_size``, ``eos_token_id``, ...;
a test checks the rule against the integer attributes of the installed gpt2 and llama configs)
and holds every value to what ``config.json`` can carry: finite numbers, text without control
characters, keys that are attribute names.
"""

from __future__ import annotations

import math
import re
from typing import Any

from lmcore.text_rules import CONTROL, IDENTIFIER, brief, escape_controls

# Attributes that transformers configs hold as whole numbers.
_INT_EXACT = frozenset(
    {"n_layer", "n_head", "n_embd", "n_positions", "n_ctx", "n_inner", "head_dim", "pretraining_tp",
     "chunk_size_feed_forward"}
)
_INT_NAME = re.compile(
    r"(?!use_|tie_)(?:"
    r"(?:n|num)_[a-z0-9_]+"  # num_hidden_layers, num_attention_heads, n_kv_heads, num_experts
    r"|[a-z0-9_]*_(?:size|layers|heads|positions|embeddings|dim|token_id|window|experts_per_tok)"
    r")"
)
_MAX_TEXT = 4096
# Counts and sizes a model cannot have none of: transformers builds 0 or -1 layers or heads
# without a word (range(-1) is empty) and trains a model without blocks, or fails at the first step.
_AT_LEAST_ONE = frozenset(
    {"n_layer", "n_head", "n_embd", "n_positions", "n_ctx", "num_hidden_layers", "num_layers",
     "num_attention_heads", "num_heads", "num_key_value_heads", "hidden_size", "intermediate_size",
     "head_dim", "vocab_size", "max_position_embeddings", "pretraining_tp"}
)


def expects_integer(key: str) -> bool:
    """True for config attributes that are whole numbers in transformers (counts, sizes, ids)."""
    return key in _INT_EXACT or _INT_NAME.fullmatch(key) is not None


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_model_config(config: dict[str, Any]) -> None:
    """ValueError naming the first value ``config.json`` could not carry as the model means it."""
    for key, value in config.items():
        if not isinstance(key, str):
            raise ValueError(f"model.config key {brief(key)} is not a name")
        try:
            IDENTIFIER.check(key)
        except ValueError as exc:
            raise ValueError(f"model.config key {exc}") from None
        if not expects_integer(key) or value is None:
            continue
        # eos_token_id may list several ids.
        items = value if isinstance(value, list) and key.endswith("token_id") else [value]
        if not all(_whole(v) for v in items):
            raise ValueError(
                f"model.config.{key} must be a whole number (it is a count, size or id), got {brief(value)}"
            )
        least = 1 if key in _AT_LEAST_ONE else 0
        if not key.endswith("token_id") and any(v < least for v in items):  # ids: against the vocabulary, later
            raise ValueError(f"model.config.{key} must be at least {least} (it is a {'count or size' if least else 'count, size or index'}), "
                             f"got {brief(value)}")
    stack: list[tuple[str, Any]] = [(f"model.config.{k}", v) for k, v in config.items()]
    while stack:
        where, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{where} is {value!r}: a model config holds finite numbers only")
        if isinstance(value, str):
            if len(value) > _MAX_TEXT:
                raise ValueError(f"{where} is {len(value)} characters long; at most {_MAX_TEXT}")
            bad = CONTROL.search(value)
            if bad:
                raise ValueError(f"{where} holds the control character {bad.group()!r}")
        elif isinstance(value, dict):
            for k, v in value.items():
                if not isinstance(k, str):
                    raise ValueError(f"{where} has the key {brief(k)}, which is not a name")
                stack.append((f"{where}.{escape_controls(k[:40])}", v))
        elif isinstance(value, list):
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(value))
