"""transformers' attention-mask preparation as lmtrain's training steps need it: no host sync.

On every forward that has position ids and no attention mask (every training step: the model
makes its own position ids), transformers looks for sequences packed into one row by their
position ids (``masking_utils.find_packed_sequence_indices``), ending in an ``if (...).all()``
that reads the device: a host sync per forward wherever the mask is made outside a compiled graph
(eager, and beside per-block compile; a whole-model compile skips it while tracing). Seen on an
H100 as about two syncs per step of GPT-2 (bench/RESULTS.md), found on CPU by a dispatch mode
(tests/unit/_count_host_reads.py). lmtrain never packs documents that way: a row is one causal
stream (documents separated by EOS, positions 0..T-1, or a sequence-parallel slice of them), so
the answer is always "not packed" (None), given here without reading the device. The memory
plan's trace (lmtrain.model.memory_facts) makes the same decision."""

from __future__ import annotations

from typing import Any


def not_packed(position_ids: Any) -> None:
    """``find_packed_sequence_indices``'s answer for an unpacked batch, read from nothing."""
    return None


def never_packed() -> None:
    """Every mask this process makes treats rows as unpacked (idempotent)."""
    import transformers.masking_utils as masks

    masks.find_packed_sequence_indices = not_packed
