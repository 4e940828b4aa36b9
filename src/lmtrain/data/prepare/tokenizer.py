"""Tokenizers for `lmlaunch data prepare`: a local transformers tokenizer directory, or bytes.

No torch here, and transformers is imported only when a tokenizer directory is given, so the
byte-level path works anywhere numpy does.

The byte-level tokenizer needs no files: ids 0..255 are the UTF-8 bytes of the text,
256 is ``<eos>`` (written after every document), 257..259 are reserved and never produced,
so the vocabulary size is 260 (a multiple of 4, which the tiny job's model config uses).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from lmcore.errors import UserError

BYTE_VOCAB_SIZE = 260
BYTE_EOS_ID = 256


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def describe(self) -> dict[str, Any]:
        """What meta.json records about this tokenizer (JSON-serialisable)."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as ids; ``<eos>`` = 256; vocabulary 260. Lossless for any text."""

    vocab_size = BYTE_VOCAB_SIZE
    eos_id = BYTE_EOS_ID

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        out = bytearray()
        parts: list[str] = []
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                out.append(i)
            elif i == self.eos_id and not skip_special:
                parts.append(out.decode("utf-8", errors="replace") + "<eos>")
                out.clear()
            elif not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the byte vocabulary 0..{self.vocab_size - 1}")
        parts.append(out.decode("utf-8", errors="replace"))
        return "".join(parts)

    def describe(self) -> dict[str, Any]:
        return {"kind": "bytes", "vocab_size": self.vocab_size, "eos_id": self.eos_id}


@dataclass
class HFTokenizer:
    """A transformers tokenizer loaded from a local directory (never from the network)."""

    path: str
    tok: Any
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        backend = getattr(self.tok, "backend_tokenizer", None)
        if backend is not None:  # the fast tokenizer itself (Rust, threaded): the same ids, no BatchEncoding
            # encode_batch_fast (tokenizers >= 0.20) leaves out the character offsets nothing here reads
            encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
            return [e.ids for e in encode(texts, add_special_tokens=False)]
        return [list(ids) for ids in self.tok(texts, add_special_tokens=False)["input_ids"]]

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "huggingface",
            "path": self.path,
            "class": type(self.tok).__name__,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
        }


def load_tokenizer(path: str | Path | None) -> ByteTokenizer | HFTokenizer:
    """The byte tokenizer for ``None``, else the transformers tokenizer in directory ``path``.

    Raises UserError (exit 2) when the directory is missing, holds no tokenizer, or the
    tokenizer has no end-of-sequence token to separate documents with.
    """
    if path is None:
        return ByteTokenizer()
    p = Path(path).expanduser()
    if not p.is_dir():
        raise UserError(
            f"--tokenizer {path}: not a directory; give a local tokenizer directory "
            "(with tokenizer.json or tokenizer_config.json), or leave --tokenizer out for bytes"
        )
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError ... for bad dirs
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"--tokenizer {path}: cannot load a tokenizer from this directory ({first}); "
            "it needs tokenizer.json or tokenizer_config.json with its vocabulary files"
        ) from exc
    eos = tok.eos_token_id if tok.eos_token_id is not None else tok.sep_token_id
    if eos is None:
        raise UserError(
            f"--tokenizer {path}: the tokenizer has no eos_token (nor sep_token) to put between "
            "documents; set eos_token in its tokenizer_config.json"
        )
    return HFTokenizer(path=str(p.resolve()), tok=tok, vocab_size=len(tok), eos_id=int(eos))
