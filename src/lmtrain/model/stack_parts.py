"""What a pipeline splits in a transformers causal LM (lmtrain.model.pipeline), found from the
model's own structure: the decoder stack (the module whose child is the list of blocks), the block
list, what runs before the blocks (the first stage's), the final norm after them (the last
stage's), the head, and whether the head is tied to the input embedding. An architecture that
cannot be split this way is refused with the reason (:class:`Unsplittable`), never guessed at."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


class Unsplittable(RuntimeError):
    """Why a causal LM cannot be split into pipeline stages (it says what it found)."""


@dataclass(frozen=True)
class Parts:
    """Where a transformers causal LM keeps what a pipeline splits: the decoder stack (the module
    whose child is the list of blocks, e.g. ``model``, ``transformer``, ``gpt_neox``,
    ``model.decoder``), its block list, what it runs before the blocks (embeddings, learned
    positions, an embedding norm: the first stage's) and after them (the final norm: the last
    stage's), and the head (on the causal LM, the last stage's)."""

    stack_path: str
    layers: str
    before: tuple[str, ...]  # children of the stack run before the blocks (first stage)
    after: tuple[str, ...]  # children of the stack run after the blocks (last stage)
    head: str
    tied: bool  # the head's weight is the input embedding's: one tensor on the first and last stage


def find_parts(lm: nn.Module) -> Parts:
    """The parts of ``lm``, found from its structure (its block class, ``_no_split_modules``; the
    stack's children in the order the model registers them, which is the order it runs them);
    :class:`Unsplittable` naming what does not fit."""
    from lmtrain.model.causal_lm import transformer_blocks

    config = getattr(lm, "config", None)
    kind = getattr(config, "model_type", type(lm).__name__)
    if getattr(config, "is_encoder_decoder", False):
        raise Unsplittable(f"{kind} is an encoder-decoder model: its two stacks are not one sequence of blocks")
    try:
        blocks = transformer_blocks(lm)
    except RuntimeError as exc:
        raise Unsplittable(str(exc)) from exc
    lists = [(name, m) for name, m in lm.named_modules() if isinstance(m, nn.ModuleList) and len(m)
             and all(any(b is x for b in blocks) for x in m)]
    if len(lists) != 1 or len(lists[0][1]) != len(blocks):
        raise Unsplittable(f"{kind}: its {len(blocks)} blocks are not one list of modules ({len(lists)} lists found)")
    path, _ = lists[0]
    stack_path, _, layers = path.rpartition(".")
    stack = lm.get_submodule(stack_path)
    head = lm.get_output_embeddings()
    head_name = next((n for n, m in lm.named_children() if m is head), None)
    if head is None or head_name is None:
        raise Unsplittable(f"{kind}: no output layer found on the causal LM (get_output_embeddings)")
    before, after = _sides(kind, stack_path, stack, layers)
    embed = lm.get_input_embeddings()
    tied = embed is not None and getattr(head, "weight", None) is getattr(embed, "weight", False)
    return Parts(stack_path, layers, before, after, head_name, tied)


FINAL_NORM_NAMES = ("ln_f", "norm_f", "ln_out")  # final norms some models register before their blocks


def _sides(kind: str, stack_path: str, stack: nn.Module, layers: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The stack's children the first stage runs before the blocks (embeddings, an embedding
    norm) and those the last stage runs after them (the final norm). Stateless ones (dropout,
    rotary embeddings) are every stage's. Anything else holding parameters (a projection in or
    out of the embedding width) could run on either side: refused rather than guessed."""
    names = [n for n, _ in stack.named_children()]
    at = names.index(layers)
    before: list[str] = []
    after: list[str] = []
    for i, name in enumerate(names):
        m = stack.get_submodule(name)
        if name == layers or not (isinstance(m, nn.Embedding) or _is_norm(m) or _holds_params(m)):
            continue
        if isinstance(m, nn.Embedding):
            before.append(name)
        elif _is_norm(m):
            (after if i > at or "final" in name or name in FINAL_NORM_NAMES else before).append(name)
        else:
            raise Unsplittable(f"{kind}: {(stack_path + '.' if stack_path else '') + name} ({type(m).__name__}) holds "
                               "parameters beside the blocks and is neither an embedding nor a norm: lmtrain cannot "
                               "tell which stage runs it")
    return tuple(before), tuple(after)


def _holds_params(m: nn.Module) -> bool:
    return any(True for _ in m.parameters())


def _is_norm(m: nn.Module) -> bool:
    return isinstance(m, nn.LayerNorm | nn.RMSNorm) or "norm" in type(m).__name__.lower()
