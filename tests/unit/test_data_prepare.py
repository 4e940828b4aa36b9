"""`lmlaunch data prepare`: tokenizers, the token file format, atomic writes, errors, the CLI."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from launcher.cli import main
from launcher.context import Context
from lmtrain.data.prepare.build import DataError, prepare, read_meta, shipped_corpus_files
from lmtrain.data.prepare.tokenizer import BYTE_EOS_ID, BYTE_VOCAB_SIZE, ByteTokenizer


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


def all_tokens(out: Path) -> list[int]:
    """Every id of a prepared directory, its shards in order."""
    from lmtrain.data.loader import TokenData

    return TokenData(out).tokens().tolist()


def shard_bytes(out: Path) -> bytes:
    return b"".join((out / s["file"]).read_bytes() for s in json.loads((out / "meta.json").read_text())["shards"])


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), Context(stdout=out, stderr=err, environ={}))
    return code, out.getvalue(), err.getvalue()


# --- the byte tokenizer ------------------------------------------------------------------------


def test_byte_tokenizer_round_trips_unicode_text():
    tok = ByteTokenizer()
    text = "Grüße, 世界! tabs\tand\nnewlines — and emoji 🚀"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert (tok.vocab_size, tok.eos_id) == (260, 256) == (BYTE_VOCAB_SIZE, BYTE_EOS_ID)


def test_byte_tokenizer_decode_shows_eos_only_when_asked_and_rejects_foreign_ids():
    tok = ByteTokenizer()
    ids = tok.encode("one") + [256] + tok.encode("two")
    assert tok.decode(ids) == "onetwo"
    assert tok.decode(ids, skip_special=False) == "one<eos>two"
    with pytest.raises(ValueError, match="outside the byte vocabulary"):
        tok.decode([300])


# --- the prepared format -----------------------------------------------------------------------


def test_prepare_writes_documents_as_flat_uint16_with_eos_after_each(tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_text("hello world", encoding="utf-8")
    jl = write_jsonl(tmp_path / "b.jsonl", ["first doc", "", "second"])
    res = prepare([txt, jl], tmp_path / "out")
    tokens = np.frombuffer(shard_bytes(tmp_path / "out"), dtype="<u2")
    expected = b"hello world" + b"\x00" + b"first doc" + b"\x00" + b"second" + b"\x00"
    want = [256 if c == 0 else c for c in expected]
    assert tokens.tolist() == want
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and meta["num_tokens"] == len(want) == res.meta.num_tokens
    assert meta["vocab_size"] == 260 and meta["eos_id"] == 256
    assert meta["num_documents"] == 3  # the empty jsonl text is not a document
    assert meta["tokenizer"]["kind"] == "bytes"
    assert [s["path"] for s in meta["sources"]] == [str(txt), str(jl)]
    assert meta["sources"][0]["sha256"] == sha256(txt)
    # one shard per input file, each with its own sha256; the index's digest covers theirs
    assert [s["file"] for s in meta["shards"]] == ["shards/00000.bin", "shards/00001.bin"]
    assert [s["documents"] for s in meta["shards"]] == [1, 2]
    assert all(s["sha256"] == sha256(tmp_path / "out" / s["file"]) for s in meta["shards"])
    assert meta["tokens_sha256"] == hashlib.sha256("".join(s["sha256"] for s in meta["shards"]).encode()).hexdigest()
    assert (meta["format"], meta["version"]) == ("lmtrain-tokens", 2)


def test_prepare_reads_directories_in_sorted_order(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "b.txt").write_text("B", encoding="utf-8")
    (corpus / "a.txt").write_text("A", encoding="utf-8")
    write_jsonl(corpus / "sub" / "c.jsonl", ["C"])
    (corpus / "notes.md").write_text("ignored", encoding="utf-8")
    prepare([corpus], tmp_path / "out")
    assert all_tokens(tmp_path / "out") == [ord("A"), 256, ord("B"), 256, ord("C"), 256]


def test_prepare_is_deterministic_same_sha256_twice(tmp_path):
    files = shipped_corpus_files()
    prepare(files, tmp_path / "one")
    prepare(files, tmp_path / "two")
    assert shard_bytes(tmp_path / "one") == shard_bytes(tmp_path / "two")
    assert (tmp_path / "one" / "meta.json").read_bytes() == (tmp_path / "two" / "meta.json").read_bytes()


def test_shipped_corpus_is_about_a_megabyte_of_english_prose(tmp_path):
    res = prepare(shipped_corpus_files(), tmp_path / "tiny")
    assert 500_000 <= res.meta.num_tokens <= 2_000_000
    assert res.meta.num_documents >= 100
    text = ByteTokenizer().decode(all_tokens(tmp_path / "tiny"))
    words = text.lower().split()
    # Real English: the most common words are function words, not random tokens.
    for w in ("the", "of", "to", "and", "a", "is"):
        assert words.count(w) > 2000, w
    assert "GNU GENERAL PUBLIC LICENSE" in text and "Return a new" in text


def test_prepare_replaces_existing_output_whole_and_leaves_no_temporaries(tmp_path):
    out = tmp_path / "out"
    prepare([write_jsonl(tmp_path / "a.jsonl", ["old text"])], out)
    prepare([write_jsonl(tmp_path / "b.jsonl", ["new"])], out)
    assert all_tokens(out) == [ord(c) for c in "new"] + [256]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "b.jsonl", "out"]


def test_failed_prepare_keeps_previous_output_intact(tmp_path):
    out = tmp_path / "out"
    prepare([write_jsonl(tmp_path / "good.jsonl", ["kept"])], out)
    before = (shard_bytes(out), (out / "meta.json").read_text())
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"txt": "typo"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"bad\.jsonl:2: .*\"text\".*txt"):
        prepare([bad], out)
    assert (shard_bytes(out), (out / "meta.json").read_text()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "good.jsonl", "out"]


def test_if_missing_keeps_valid_data_and_rebuilds_corrupt_data(tmp_path):
    out = tmp_path / "out"
    src = write_jsonl(tmp_path / "a.jsonl", ["abc"])
    first = prepare([src], out)
    assert not first.skipped
    again = prepare([write_jsonl(tmp_path / "b.jsonl", ["other"])], out, if_missing=True)
    assert again.skipped and again.meta == first.meta
    (out / "shards" / "00000.bin").write_bytes(b"\x00")  # truncated
    rebuilt = prepare([src], out, if_missing=True)
    assert not rebuilt.skipped
    assert read_meta(out, verify_checksum=True).num_tokens == 4


# --- bad input ---------------------------------------------------------------------------------


def put(d: Path, name: str, content: str | bytes | None) -> Path:
    """Create ``d/name``: a file with ``content``, or a directory when content is None."""
    p = d / name
    if content is None:
        p.mkdir()
    elif isinstance(content, bytes):
        p.write_bytes(content)
    else:
        p.write_text(content, encoding="utf-8")
    return p


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: d / "missing.txt", r"missing\.txt: no such file or directory"),
        (lambda d: put(d, "t.csv", "a,b"), r"unsupported input type '\.csv'"),
        (lambda d: put(d, "e.txt", ""), r"empty corpus"),
        (lambda d: write_jsonl(d / "e.jsonl", ["", ""]), r"empty corpus"),
        (lambda d: put(d, "n.jsonl", '{"text": "ok"}\nnot json\n'), r"n\.jsonl:2: not a JSON object"),
        (lambda d: put(d, "l.jsonl", '["text"]\n'), r"l\.jsonl:1: .*found a JSON list"),
        (lambda d: put(d, "u.txt", b"ok\xff\xfe"), r"u\.txt: not UTF-8 text \(invalid byte at offset 2\)"),
        (lambda d: put(d, "empty", None), r"empty: directory holds no \.txt, \.jsonl, \.jsonl\.gz, \.jsonl\.zst, \.parquet files"),
    ],
    ids=["missing", "csv", "empty-txt", "empty-jsonl", "bad-json", "not-object", "not-utf8", "empty-dir"],
)
def test_bad_input_is_a_clear_data_error(tmp_path, make, message):
    path = make(tmp_path)
    with pytest.raises(DataError, match=message):
        prepare([path], tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")]


# --- meta validation ---------------------------------------------------------------------------


@pytest.fixture
def prepared(tmp_path) -> Path:
    prepare([write_jsonl(tmp_path / "a.jsonl", ["some text", "more text"])], tmp_path / "d")
    return tmp_path / "d"


def _edit_meta(d: Path, **changes) -> None:
    meta = json.loads((d / "meta.json").read_text())
    meta.update(changes)
    (d / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda d: (d / "meta.json").unlink(), r"meta\.json: missing \(not a prepared data directory\)"),
        (lambda d: (d / "meta.json").write_text("{nope"), r"meta\.json: not valid JSON"),
        (lambda d: _edit_meta(d, format="other"), r"'format' must be 'lmtrain-tokens'"),
        (lambda d: _edit_meta(d, version=9), r"'version' is 9, this lmtrain reads versions 1, 2"),
        (lambda d: _edit_meta(d, dtype="int8"), r"'dtype' must be one of \['uint16', 'uint32'\]"),
        (lambda d: _edit_meta(d, num_tokens="12"), r"'num_tokens' must be an integer >= 1"),
        (lambda d: _edit_meta(d, eos_id=400), r"'eos_id' \(400\) must be < 'vocab_size' \(260\)"),
        (lambda d: _edit_meta(d, vocab_size=70000), r"'vocab_size' \(70000\) does not fit 'dtype' uint16"),
        (lambda d: (d / "shards" / "00000.bin").unlink(), r"shards/00000\.bin: missing \(meta\.json lists it\)"),
        (
            lambda d: (d / "shards" / "00000.bin").write_bytes(b"\x01\x00" * 3),
            r"6 bytes, but meta\.json says its tokens\(20\) x uint16\(2 bytes\) = 40 bytes",
        ),
        (lambda d: _edit_meta(d, shards=[]), r"'shards' must be a non-empty list"),
        (lambda d: _edit_meta(d, shards=[{"file": "../x.bin", "tokens": 20, "sha256": "0" * 64}]),
         r"shards\[0\] must be \{file: shards/\.\.\., tokens: >= 1, sha256: 64 hex\}"),
        (lambda d: _edit_meta(d, num_tokens=21), r"its shards hold 20 tokens, but 'num_tokens' is 21"),
    ],
    ids=[
        "no-meta",
        "bad-json",
        "format",
        "version",
        "dtype",
        "num-tokens-type",
        "eos",
        "vocab-dtype",
        "no-shard",
        "truncated",
        "no-shards",
        "shard-outside",
        "count-mismatch",
    ],
)
def test_read_meta_rejects_corrupt_prepared_data(prepared, corrupt, message):
    corrupt(prepared)
    with pytest.raises(DataError, match=message) as exc:
        read_meta(prepared)
    assert "lmlaunch data prepare" in str(exc.value) or "meta.json" in str(exc.value)


def test_read_meta_checksum_catches_flipped_tokens(prepared):
    data = bytearray((prepared / "shards" / "00000.bin").read_bytes())
    data[0] ^= 1
    (prepared / "shards" / "00000.bin").write_bytes(bytes(data))
    read_meta(prepared)  # the size still matches: only the checksum can tell
    with pytest.raises(DataError, match=r"shards/00000\.bin: sha256 \w+ does not match its sha256 in meta\.json"):
        read_meta(prepared, verify_checksum=True)
    code, _, err = cli("data", "info", str(prepared), "--verify")
    assert code == 2 and "shards/00000.bin: sha256" in err, err


def test_version_1_directories_are_still_read(prepared):
    """A flat tokens.bin with a version 1 meta.json (what earlier lmlaunch wrote) trains as before."""
    from lmtrain.data.loader import TokenData

    meta = json.loads((prepared / "meta.json").read_text())
    (prepared / "tokens.bin").write_bytes(shard_bytes(prepared))
    digest = sha256(prepared / "tokens.bin")
    for key in ("shards", "text_key"):
        meta.pop(key)
    meta.update(version=1, tokens_sha256=digest)
    import shutil

    shutil.rmtree(prepared / "shards")
    (prepared / "meta.json").write_text(json.dumps(meta))
    assert read_meta(prepared, verify_checksum=True).shards == [
        {"file": "tokens.bin", "tokens": 20, "documents": 2, "sha256": digest}]
    assert ByteTokenizer().decode(TokenData(prepared).tokens().tolist()) == "some textmore text"


def test_read_meta_on_missing_directory_says_how_to_make_it(tmp_path):
    with pytest.raises(DataError, match=r"no such directory; make it with: lmlaunch data prepare"):
        read_meta(tmp_path / "nothing")


# --- a local transformers tokenizer ------------------------------------------------------------


def _save_word_tokenizer(d: Path, *, eos: bool = True) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "</s>": 1, "the": 2, "cat": 3, "sat": 4, "on": 5, "mat": 6}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    kwargs = {"eos_token": "</s>"} if eos else {}
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", **kwargs).save_pretrained(str(d))
    return d


def test_prepare_with_a_local_tokenizer_directory(tmp_path):
    tok_dir = _save_word_tokenizer(tmp_path / "tok")
    src = write_jsonl(tmp_path / "a.jsonl", ["the cat sat", "on the mat dog"])
    res = prepare([src], tmp_path / "out", tokenizer=tok_dir)
    assert all_tokens(tmp_path / "out") == [2, 3, 4, 1, 5, 2, 6, 0, 1]
    assert res.meta.vocab_size == 7 and res.meta.eos_id == 1
    assert res.meta.tokenizer["kind"] == "huggingface"
    assert res.meta.tokenizer["path"] == str(tok_dir.resolve())


def test_bad_tokenizer_directories_are_clear_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    src = write_jsonl(tmp_path / "a.jsonl", ["the cat"])
    code, _, err = cli(
        "data", "prepare", str(src), "--out", str(tmp_path / "o"), "--tokenizer", str(tmp_path / "empty")
    )
    assert code == 2 and "cannot load a tokenizer from this directory" in err
    code, _, err = cli(
        "data", "prepare", str(src), "--out", str(tmp_path / "o"), "--tokenizer", str(tmp_path / "none")
    )
    assert code == 2 and "not a directory" in err
    no_eos = _save_word_tokenizer(tmp_path / "noeos", eos=False)
    code, _, err = cli("data", "prepare", str(src), "--out", str(tmp_path / "o"), "--tokenizer", str(no_eos))
    assert code == 2 and "has no eos_token" in err
    assert not (tmp_path / "o").exists()


# --- the CLI -----------------------------------------------------------------------------------


def test_cli_prepare_shipped_corpus_then_if_missing_skips(tmp_path):
    out = tmp_path / "prepared" / "tiny"
    code, stdout, _ = cli("data", "prepare", "--shipped-corpus", "--out", str(out), "--if-missing")
    assert code == 0 and "156 documents from 2 files" in stdout and "uint16, vocab_size 260" in stdout
    stamp = (out / "meta.json").stat().st_mtime_ns
    code, stdout, _ = cli("data", "prepare", "--shipped-corpus", "--out", str(out), "--if-missing")
    assert code == 0 and "--if-missing: kept as is" in stdout
    assert (out / "meta.json").stat().st_mtime_ns == stamp
    code, stdout, _ = cli("data", "info", str(out), "--verify")
    assert code == 0 and "sha256 verified" in stdout and "vocab_size 260" in stdout


def test_cli_prepare_bad_arguments_exit_2(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", ["x"])
    code, _, err = cli("data", "prepare", "--out", str(tmp_path / "o"))
    assert code == 2 and "nothing to tokenize" in err
    code, _, err = cli("data", "prepare", str(src), "--shipped-corpus", "--out", str(tmp_path / "o"))
    assert code == 2 and "not both" in err
    code, _, err = cli("data", "prepare", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "o"))
    assert code == 2 and "nope.txt: no such file or directory" in err
    code, _, err = cli("data", "info", str(tmp_path / "o"))
    assert code == 2 and "no such directory" in err
    code, _, err = cli("data")
    assert code == 2 and "usage: lmlaunch data" in err


def test_data_command_never_imports_torch_for_byte_prepare(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", ["x"])
    code = (
        "import sys, launcher.commands.data\n"
        "assert 'torch' not in sys.modules, 'imported at module import'\n"
        "from launcher.cli import main\n"
        f"rc = main(['data', 'prepare', {str(src)!r}, '--out', {str(tmp_path / 'o')!r}])\n"
        "heavy = [m for m in ('torch', 'lightning', 'transformers') if m in sys.modules]\n"
        "print(heavy); sys.exit(rc or (1 if heavy else 0))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_vocabularies_beyond_uint16_are_stored_as_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from lmtrain.data.loader import TokenData

    vocab = {"[UNK]": 0, "</s>": 1, **{f"w{i}": i for i in range(2, 70_000)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", eos_token="</s>").save_pretrained(
        str(tmp_path / "tok")
    )
    src = write_jsonl(tmp_path / "a.jsonl", ["w2 w65535 w65536 w69999"])
    res = prepare([src], tmp_path / "out", tokenizer=tmp_path / "tok")
    assert res.meta.dtype == "uint32" and res.meta.vocab_size == 70_000
    train, _ = TokenData(tmp_path / "out").split(5, 0.0)
    assert train[0]["input_ids"].tolist() == [2, 65535, 65536, 69999, 1]


def test_if_missing_keeps_data_a_concurrent_prepare_finished_first(tmp_path, monkeypatch):
    import lmtrain.data.prepare.build as prep

    out = tmp_path / "out"
    theirs = write_jsonl(tmp_path / "theirs.jsonl", ["first finisher"])
    real_collect = prep.collect_inputs

    def collect_while_another_process_finishes(inputs):
        monkeypatch.setattr(prep, "collect_inputs", real_collect)
        prep.prepare([theirs], out)  # the other process lands while this call is tokenizing
        return real_collect(inputs)

    monkeypatch.setattr(prep, "collect_inputs", collect_while_another_process_finishes)
    res = prep.prepare([write_jsonl(tmp_path / "mine.jsonl", ["second"])], out, if_missing=True)
    assert res.skipped
    assert [s["path"] for s in read_meta(out).sources] == [str(theirs)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.jsonl", "out", "theirs.jsonl"]
    replaced = prep.prepare([tmp_path / "mine.jsonl"], out)  # without --if-missing: replaced
    assert not replaced.skipped and [s["path"] for s in replaced.meta.sources] == [
        str(tmp_path / "mine.jsonl")
    ]
