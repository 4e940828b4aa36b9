"""Real corpora's inputs (lmtrain.data.prepare.corpus) and a tokenizer trained on them (lmtrain.data.prepare.tokenizer_train):

- .jsonl.zst, .jsonl.gz and parquet files (and globs over them) give the same documents as plain
  .jsonl, streamed: the shipped corpus split into such files prepares to the same tokens, byte for
  byte, as the shipped .jsonl files;
- every bad input is an error naming the file and the line or row; --skip-bad counts and skips
  bad documents and records the count;
- `data train-tokenizer` trains a byte-level BPE tokenizer that round-trips every document, is
  the same when trained twice, and `data prepare --tokenizer` uses it.
"""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from launcher.cli import main
from launcher.context import Context
from lmtrain.data.prepare.build import prepare, read_meta, shipped_corpus_files
from lmtrain.data.prepare.corpus import BadDocuments, DataError, collect_inputs, iter_documents


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), Context(stdout=out, stderr=err, environ={}))
    return code, out.getvalue(), err.getvalue()


def _lines(texts: list[str], key: str = "text") -> bytes:
    return "".join(json.dumps({key: t, "id": i}) + "\n" for i, t in enumerate(texts)).encode()


def write(path: Path, texts: list[str], key: str = "text") -> Path:
    """``texts`` in the format ``path``'s suffix names."""
    if path.name.endswith(".jsonl.zst"):
        path.write_bytes(zstandard.ZstdCompressor().compress(_lines(texts, key)))
    elif path.name.endswith(".jsonl.gz"):
        path.write_bytes(gzip.compress(_lines(texts, key)))
    elif path.suffix == ".parquet":
        pq.write_table(pa.table({key: texts, "id": list(range(len(texts)))}), path, row_group_size=7)
    else:
        path.write_bytes(_lines(texts, key))
    return path


def shipped_documents() -> list[str]:
    return [d for f in shipped_corpus_files() for d in iter_documents(f)]


@pytest.fixture(scope="module")
def split_corpus(tmp_path_factory) -> Path:
    """The shipped corpus as 6 files: .jsonl.zst, .parquet and .jsonl.gz, in order."""
    d = tmp_path_factory.mktemp("corpus")
    docs = shipped_documents()
    n = len(docs)
    kinds = [".jsonl.zst", ".parquet", ".jsonl.gz"]
    for i in range(6):
        write(d / f"part-{i}{kinds[i % 3]}", docs[i * n // 6:(i + 1) * n // 6])
    return d


def test_every_format_gives_the_documents_in_order(tmp_path):
    texts = ["first doc", "", "ünïcode ✓ and 中文", "a\nmulti-line\ndocument"]
    for suffix in (".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet"):
        path = write(tmp_path / f"d{suffix}", texts)
        assert list(iter_documents(path)) == [t for t in texts if t], suffix  # empty texts left out
    custom = write(tmp_path / "c.parquet", texts, key="content")
    assert list(iter_documents(custom, text_key="content")) == [t for t in texts if t]


def test_split_corpus_prepares_to_the_shipped_corpus_tokens(tmp_path, split_corpus):
    whole = prepare(shipped_corpus_files(), tmp_path / "whole").meta
    by_glob = prepare([str(split_corpus / "part-*")], tmp_path / "glob").meta
    by_dir = prepare([split_corpus], tmp_path / "dir").meta
    assert whole.num_documents == by_glob.num_documents == by_dir.num_documents > 100
    assert by_glob.tokens_sha256 == by_dir.tokens_sha256 and len(by_glob.shards) == 6  # one shard per file
    from lmtrain.data.loader import TokenData

    assert len(whole.shards) == 2
    assert (TokenData(tmp_path / "whole").tokens() == TokenData(tmp_path / "glob").tokens()).all()  # the same ids
    assert [Path(s["path"]).name for s in by_glob.sources] == [f"part-{i}{k}" for i, k in
                                                             enumerate([".jsonl.zst", ".parquet", ".jsonl.gz"] * 2)]


def test_compressed_inputs_are_streamed_not_loaded(tmp_path):
    """A 40 MB .jsonl.zst (a few hundred KB compressed) is read one line at a time: the first
    document arrives before the stream is read further."""
    doc = "x" * 1000
    path = tmp_path / "big.jsonl.zst"
    with open(path, "wb") as raw, zstandard.ZstdCompressor().stream_writer(raw) as w:
        for _ in range(40_000):
            w.write((json.dumps({"text": doc}) + "\n").encode())
    assert path.stat().st_size < 2_000_000
    docs = iter_documents(path)
    assert next(docs) == doc
    import tracemalloc

    tracemalloc.start()
    count = 1 + sum(1 for _ in docs)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert count == 40_000 and peak < 8_000_000, (count, peak)


def _corrupt_zst(d: Path) -> Path:
    p = write(d / "c.jsonl.zst", ["ok"] * 200)
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))
    return p


def _truncated_gz(d: Path) -> Path:
    p = write(d / "t.jsonl.gz", [f"document {i}" for i in range(2000)])
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    return p


def _non_utf8_parquet(d: Path) -> Path:
    """A string column holding bytes that are not UTF-8 (parquet writes them unchecked)."""
    raw = pa.array([b"good", b"\xff\xfe bad", b"fine"], type=pa.binary())
    pq.write_table(pa.table({"text": pa.Array.from_buffers(pa.string(), len(raw), raw.buffers())}), d / "u8.parquet")
    return d / "u8.parquet"


def _broken_parquet(d: Path) -> Path:
    p = write(d / "b.parquet", ["ok"] * 10)
    p.write_bytes(p.read_bytes()[:-20])
    return p


@pytest.mark.parametrize("make, message", [
    (_corrupt_zst, r"c\.jsonl\.zst: not a readable \.jsonl\.zst stream after line \d+ \(ZstdError"),
    (_truncated_gz, r"t\.jsonl\.gz: not a readable \.jsonl\.gz stream after line \d+ .*corrupt or truncated"),
    (_broken_parquet, r"b\.parquet: not a readable parquet file"),
    (_non_utf8_parquet, r"u8\.parquet: row 2: 'text' is not UTF-8 text \(invalid byte at offset 0\)"),
    (lambda d: write(d / "k.jsonl.zst", ["a", "b"], key="body"),
     r"k\.jsonl\.zst:1: each line must be a JSON object with a string \"text\" \(found keys \['body', 'id'\]\)"),
    (lambda d: ((d / "u.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "\xff"}\n'), d / "u.jsonl")[1],
     r"u\.jsonl:2: not UTF-8 text"),
    (lambda d: (pq.write_table(pa.table({"text": ["a", None, "c"]}), d / "n.parquet"), d / "n.parquet")[1],
     r"n\.parquet: row 2: 'text' is null"),
    (lambda d: write(d / "m.parquet", ["a"], key="content"),
     r"m\.parquet: no column 'text' \(its columns: content, id\); name the text column with --text-key"),
    (lambda d: write(d / "e.jsonl.zst", ["", ""]), r"empty corpus"),
    (lambda d: d / "nothing-*.parquet", r"nothing-\*\.parquet: the pattern matches no"),
], ids=["corrupt-zst", "truncated-gz", "broken-parquet", "non-utf8-parquet", "no-text-field", "not-utf8", "null-row",
        "no-column", "empty", "glob-no-match"])
def test_bad_inputs_name_the_file_and_the_line_or_row(tmp_path, make, message):
    path = make(tmp_path)
    with pytest.raises(DataError, match=message):
        prepare([str(path)], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_skip_bad_counts_and_skips_bad_documents_and_records_them(tmp_path):
    (tmp_path / "mixed.jsonl").write_bytes(b'{"text": "good one"}\nnot json\n{"body": "x"}\n{"text": "\xff"}\n'
                                           b'{"text": "good two"}\n')
    pq.write_table(pa.table({"text": ["p1", None, "p2"]}), tmp_path / "p.parquet")
    with pytest.raises(DataError, match=r"mixed\.jsonl:2: not a JSON object .*--skip-bad counts and skips"):
        prepare([tmp_path / "mixed.jsonl"], tmp_path / "out")
    m = prepare([tmp_path / "mixed.jsonl", tmp_path / "p.parquet"], tmp_path / "out", skip_bad=True).meta
    assert m.num_documents == 4 and m.skipped_documents["count"] == 4
    assert [s["skipped"] for s in m.sources] == [3, 1]
    assert read_meta(tmp_path / "out").skipped_documents == m.skipped_documents  # in meta.json
    code, out, err = cli("data", "prepare", str(tmp_path / "mixed.jsonl"), "--out", str(tmp_path / "o2"), "--skip-bad")
    assert code == 0 and "3 bad document(s) skipped, e.g." in err and "mixed.jsonl:2: not a JSON object" in err, err
    code, out, _ = cli("data", "info", str(tmp_path / "o2"))
    assert "skipped documents (--skip-bad): 3" in out and "3 skipped" in out, out
    skip = BadDocuments()
    assert list(iter_documents(tmp_path / "mixed.jsonl", skip=skip)) == ["good one", "good two"] and skip.count == 3
    skip = BadDocuments()
    assert list(iter_documents(_non_utf8_parquet(tmp_path), skip=skip)) == ["good", "fine"] and skip.count == 1


def test_trained_tokenizer_round_trips_is_reproducible_and_prepares(tmp_path, split_corpus):
    code, out, err = cli("data", "train-tokenizer", str(split_corpus), "--out", str(tmp_path / "tok"),
                         "--vocab-size", "1024")
    assert code == 0, err
    assert "vocab_size 1,024 (eos <|endoftext|> = 0), trained on" in out and "from 6 file(s)" in out, out
    assert "a model for it: model.config.vocab_size: 1024, eos_token_id: 0" in out, out
    code, _, err = cli("data", "train-tokenizer", str(split_corpus), "--out", str(tmp_path / "tok2"),
                       "--vocab-size", "1024")
    assert code == 0, err
    assert (tmp_path / "tok" / "tokenizer.json").read_bytes() == (tmp_path / "tok2" / "tokenizer.json").read_bytes()

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "tok", local_files_only=True)
    docs = shipped_documents()
    for doc in docs:
        assert tok.decode(tok(doc, add_special_tokens=False)["input_ids"]) == doc
    assert len(tok(docs[0])["input_ids"]) < len(docs[0].encode()) / 2  # it learnt merges

    m = prepare([split_corpus], tmp_path / "prep", tokenizer=tmp_path / "tok").meta
    assert (m.vocab_size, m.eos_id, m.tokenizer["kind"], m.num_documents) == (1024, 0, "huggingface", len(docs))
    code, _, err = cli("data", "train-tokenizer", str(split_corpus), "--out", str(tmp_path / "t3"), "--vocab-size", "100")
    assert code == 2 and "--vocab-size 100: must be between 257" in err, err


def test_inputs_are_collected_in_a_fixed_order(tmp_path, split_corpus):
    files = collect_inputs([str(split_corpus / "part-[3-5]*"), split_corpus / "part-0.jsonl.zst"])
    assert [f.name for f in files] == ["part-3.jsonl.zst", "part-4.parquet", "part-5.jsonl.gz", "part-0.jsonl.zst"]
    (tmp_path / "x.csv").write_text("a")
    with pytest.raises(DataError, match=r"x\.csv: unsupported input type '\.csv'; allowed: \.txt, \.jsonl"):
        collect_inputs([tmp_path / "x.csv"])


def test_batches_across_files_give_the_bytes_of_one_file_at_a_time(tmp_path, split_corpus, monkeypatch):
    """The tokenizer is called with the documents of several files at once (up to BATCH_DOCUMENTS
    or BATCH_CHARS); the shards are byte for byte those of one document per call."""
    from lmtrain.data.prepare import token_store
    from lmtrain.data.prepare.tokenizer_train import train_tokenizer

    train_tokenizer([split_corpus], tmp_path / "tok", vocab_size=600)
    trees = []
    for docs, chars in ((1, 10**9), (7, 10**9), (10**6, 5_000), (10**6, 10**9)):
        monkeypatch.setattr(token_store, "BATCH_DOCUMENTS", docs)
        monkeypatch.setattr(token_store, "BATCH_CHARS", chars)
        out = tmp_path / f"o-{docs}-{chars}"
        prepare([split_corpus], out, tokenizer=tmp_path / "tok")
        trees.append({p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()})
    assert all(t == trees[0] for t in trees[1:]) and len(trees[0]) == 13  # 6 shards, their records, the index


def test_a_bad_input_after_good_ones_is_an_error_after_their_shards_are_finished(tmp_path, split_corpus):
    """The documents of good inputs read before a corrupt one are written and their shards
    closed (a rerun keeps them); nothing of the bad input or those after it; no thread left."""
    import threading

    import numpy as np

    from lmtrain.data.prepare.build import write_shards
    from lmtrain.data.prepare.corpus import Preparation
    from lmtrain.data.prepare.token_store import finished

    files = sorted(split_corpus.iterdir())
    bad = _corrupt_zst(tmp_path)
    prep = Preparation([files[0], files[1], bad, files[2]], None)
    root = tmp_path / "store"
    with pytest.raises(DataError, match=r"c\.jsonl\.zst: not a readable \.jsonl\.zst stream after line"):
        write_shards(root, prep, prep.jobs())
    jobs = prep.jobs()
    assert [finished(root, j, np.dtype(np.uint16).itemsize) is not None for j in jobs] == [True, True, False, False]
    assert sorted(p.name for p in (root / "shards").iterdir()) == ["00000.bin", "00000.json", "00001.bin", "00001.json"]
    assert not [t for t in threading.enumerate() if t.name == "lmtrain-read-ahead"]
    kept = []
    fixed = Preparation([files[0], files[1], files[3], files[2]], None)  # the bad file replaced: 0 and 1 are kept
    write_shards(root, fixed, fixed.jobs(), on_kept=kept.append)
    assert [r["file"] for r in kept] == ["shards/00000.bin", "shards/00001.bin"]
    again: list = []
    other = Preparation(fixed.files, None, skip_bad=True)  # another recipe: nothing of the first is finished for it
    write_shards(root, other, other.jobs(), on_kept=again.append)
    assert again == [] and json.loads((root / "shards" / "00000.json").read_text())["recipe"] == other.recipe


def test_a_tokenizer_retrained_in_the_same_directory_is_another_recipe(tmp_path, split_corpus):
    from lmtrain.data.prepare.corpus import Preparation
    from lmtrain.data.prepare.tokenizer_train import train_tokenizer

    train_tokenizer([split_corpus], tmp_path / "tok", vocab_size=500)
    first = Preparation([], str(tmp_path / "tok")).recipe
    assert Preparation([], str(tmp_path / "tok")).recipe == first  # the same content: the same recipe
    train_tokenizer([split_corpus], tmp_path / "tok", vocab_size=520)
    assert Preparation([], str(tmp_path / "tok")).recipe != first
    assert Preparation([], None).recipe != Preparation([], None, text_key="body").recipe
