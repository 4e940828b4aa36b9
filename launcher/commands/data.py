"""lmlaunch data prepare INPUT... --out DIR [--tokenizer DIR] [--if-missing]
lmlaunch data prepare --shipped-corpus --out DIR [--if-missing]
lmlaunch data info DIR [--verify]

Nothing heavy at import: lmtrain.prepare (numpy, no torch) is imported inside run(), and
transformers only when --tokenizer names a tokenizer directory.
"""

from __future__ import annotations

import argparse
import json

from launcher import runtime_stack
from launcher.context import Context
from launcher.core.errors import ExitCode, UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="data_command", metavar="ACTION")
    prep = sub.add_parser(
        "prepare",
        help="tokenize local text into DIR/tokens.bin + DIR/meta.json",
        description=(
            "Tokenize local text (.txt: one document per file; .jsonl: one JSON object with a "
            "'text' field per line; directories are searched for both) into a flat token file. "
            "Without --tokenizer the byte-level tokenizer is used (ids 0-255 = bytes, 256 = <eos>, "
            "vocab_size 260)."
        ),
    )
    prep.add_argument("inputs", nargs="*", metavar="INPUT", help=".txt/.jsonl files or directories")
    prep.add_argument("--out", required=True, metavar="DIR", help="output directory (written atomically)")
    prep.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="local transformers tokenizer directory (never downloaded); default: bytes",
    )
    prep.add_argument(
        "--shipped-corpus",
        action="store_true",
        help="tokenize the corpus that ships with lmlaunch (data/corpus/: license texts and "
        "Python standard-library documentation, ~1.2 MB of English)",
    )
    prep.add_argument(
        "--if-missing", action="store_true", help="do nothing when DIR already holds valid prepared data"
    )
    info = sub.add_parser("info", help="show what a prepared data directory holds")
    info.add_argument("dir", metavar="DIR")
    info.add_argument("--verify", action="store_true", help="also check tokens.bin against its sha256")
    info.add_argument("--json", action="store_true", help="print meta.json as read")


def run(args: argparse.Namespace, ctx: Context) -> int:
    if args.data_command == "prepare":
        return _prepare(args, ctx)
    if args.data_command == "info":
        return _info(args, ctx)
    ctx.err("usage: lmlaunch data {prepare,info} ... (see lmlaunch data --help)")
    return ExitCode.USAGE


def _prepare(args: argparse.Namespace, ctx: Context) -> int:
    runtime_stack.require("data prepare", ("numpy",) + (("transformers",) if args.tokenizer else ()))
    from lmtrain.prepare import prepare, shipped_corpus_files

    if args.shipped_corpus and args.inputs:
        raise UserError("give INPUT files or --shipped-corpus, not both")
    if not args.shipped_corpus and not args.inputs:
        raise UserError(
            "nothing to tokenize: give INPUT files/directories (.txt, .jsonl) or --shipped-corpus"
        )
    inputs = shipped_corpus_files() if args.shipped_corpus else args.inputs
    result = prepare(inputs, args.out, tokenizer=args.tokenizer, if_missing=args.if_missing)
    m = result.meta
    if result.skipped:
        ctx.out(f"ok: {result.out} already holds {m.num_tokens:,} tokens (--if-missing: kept as is)")
        return 0
    ctx.out(
        f"ok: {result.out}: {m.num_documents:,} documents from {len(m.sources)} files -> "
        f"{m.num_tokens:,} tokens ({m.dtype}, vocab_size {m.vocab_size}, eos {m.eos_id}, "
        f"tokenizer {m.tokenizer.get('kind')})"
    )
    return 0


def _info(args: argparse.Namespace, ctx: Context) -> int:
    runtime_stack.require("data info", ("numpy",))
    from lmtrain.prepare import read_meta

    m = read_meta(args.dir, verify_checksum=args.verify)
    if args.json:
        ctx.out(json.dumps(m.to_json(), indent=2, sort_keys=True))
        return 0
    ctx.out(f"{args.dir}: {m.num_tokens:,} tokens, {m.num_documents:,} documents")
    ctx.out(f"  dtype {m.dtype}, vocab_size {m.vocab_size}, eos_id {m.eos_id}")
    ctx.out(f"  tokenizer: {json.dumps(m.tokenizer, sort_keys=True)}")
    for s in m.sources:
        ctx.out(f"  source {s.get('path')}: {s.get('documents')} documents, {s.get('tokens')} tokens")
    if args.verify:
        ctx.out(f"  tokens.bin sha256 verified: {m.tokens_sha256}")
    return 0
