"""``lmlaunch data train-tokenizer``: a byte-level BPE tokenizer trained on a local corpus.

Nothing can be downloaded on a cluster's login node, and a corpus may not match any published
tokenizer: this trains one with the ``tokenizers`` library (byte-level BPE, as GPT-2's: every
UTF-8 byte is in the initial alphabet, so any text encodes, and decoding gives it back) and saves
it as a transformers tokenizer directory (``tokenizer.json`` + ``tokenizer_config.json``), which
``data prepare --tokenizer DIR``, training (the data's vocabulary) and ``export`` (the exported
model's tokenizer) read like any local transformers tokenizer.

The documents are read as ``prepare`` reads them (lmtrain.data.prepare.corpus: every input format, streamed),
in the same order; the same inputs and settings give the same tokenizer. ``<|endoftext|>`` is
id 0: the end-of-document token ``prepare`` writes after each document.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from lmtrain.data.prepare.corpus import BadDocuments, DataError, collect_inputs, iter_documents

EOS = "<|endoftext|>"
MIN_VOCAB = 257  # the 256 bytes and <|endoftext|>
MAX_VOCAB = 1 << 20


def train_tokenizer(inputs: Sequence[str | Path], out: str | Path, *, vocab_size: int, text_key: str = "text",
                    skip_bad: bool = False, min_frequency: int = 2) -> dict[str, Any]:
    """Train on ``inputs``, save to ``out``; a summary (files, documents, vocabulary, skipped)."""
    if not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise DataError(f"--vocab-size {vocab_size}: must be between {MIN_VOCAB} (the 256 bytes and "
                        f"{EOS}) and {MAX_VOCAB}")
    if min_frequency < 1:
        raise DataError(f"--min-frequency {min_frequency}: must be >= 1")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = collect_inputs(inputs)
    skip = BadDocuments() if skip_bad else None
    counted = {"documents": 0}

    def documents() -> Iterator[str]:
        for path in files:
            for doc in iter_documents(path, text_key=text_key, skip=skip):
                counted["documents"] += 1
                yield doc

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(documents(), trainer=trainer)
    if counted["documents"] == 0:
        raise DataError(f"empty corpus: {', '.join(str(p) for p in files)} hold no text to train a tokenizer on")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=None,
                                   model_max_length=1 << 30, clean_up_tokenization_spaces=False)
    target = Path(out).expanduser().absolute()
    target.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(target))
    return {"out": str(target), "files": len(files), "documents": counted["documents"],
            "vocab_size": len(fast), "eos_id": fast.eos_token_id,
            "skipped_documents": skip.to_json() if skip is not None else None}
