"""lmlaunch data prepare INPUT... --out DIR [--tokenizer DIR] [--text-key K] [--skip-bad] [--if-missing]
lmlaunch data prepare --shipped-corpus --out DIR [--if-missing]
lmlaunch data train-tokenizer INPUT... --out DIR --vocab-size N [--text-key K] [--skip-bad]
lmlaunch data info DIR [--verify]

Nothing heavy at import: lmtrain.data.prepare.build (numpy, no torch) is imported inside run(), and
transformers only when --tokenizer names a tokenizer directory.
"""

from __future__ import annotations

import argparse
import json

from launcher.context import Context
from launcher.planning import runtime_stack
from lmcore.errors import ExitCode, UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="data_command", metavar="ACTION")
    prep = sub.add_parser(
        "prepare",
        help="tokenize local text into a sharded token store DIR (one shard per input file + meta.json)",
        description=(
            "Tokenize local text into a flat token file: .txt (one document per file); .jsonl, "
            ".jsonl.gz, .jsonl.zst (one JSON object per line, its text under --text-key); .parquet "
            "(the --text-key column). Compressed and parquet files are read as streams; directories "
            "and glob patterns ('corpus/**/*.jsonl.zst') are expanded in sorted order. Without "
            "--tokenizer the byte-level tokenizer is used (ids 0-255 = bytes, 256 = <eos>, vocab_size 260)."
        ),
    )
    prep.add_argument("inputs", nargs="*", metavar="INPUT", help="files, directories or glob patterns")
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
    _document_options(prep)
    _on_cluster_options(prep)
    _train_tokenizer_parser(sub)
    info = sub.add_parser("info", help="show what a prepared data directory holds")
    info.add_argument("dir", metavar="DIR")
    info.add_argument("--verify", action="store_true", help="also check every shard against its sha256 (reads them all)")
    info.add_argument("--json", action="store_true", help="print meta.json as read")


def _on_cluster_options(prep: argparse.ArgumentParser) -> None:
    on = prep.add_argument_group("on the cluster (--on-cluster)")
    on.add_argument("--on-cluster", action="store_true",
                    help="run it as one throttled SLURM array (a task per slice of the files) and a final step that "
                    "writes the index; a preempted task redoes only the shards it had not finished")
    on.add_argument("--cluster", default="local", metavar="PROFILE", help="cluster profile (default: local)")
    on.add_argument("--tasks", type=int, default=4, metavar="N", help="array tasks, each a contiguous slice of the files")
    on.add_argument("--max-parallel", type=int, default=4, metavar="K", help="tasks running at once (sbatch --array ...%%K)")
    on.add_argument("--array-size", type=int, metavar="M",
                    help="at most M tasks per array (default: the cluster's MaxArraySize); more tasks go into arrays "
                    "chained one after another (e.g. a site whose QOS caps a user's queued jobs)")
    on.add_argument("--name", metavar="RUN", help="the run's name (default: prepare-<OUT's name>)")
    on.add_argument("--partition", metavar="P", help="default: the profile's preemptible partition, else its default")
    on.add_argument("--time", default="01:00:00", metavar="T", help="time limit of each task (default 01:00:00)")


def _train_tokenizer_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    train = sub.add_parser(
        "train-tokenizer",
        help="train a byte-level BPE tokenizer on local text into a transformers tokenizer directory",
        description=("Train a byte-level BPE tokenizer (the tokenizers library) on the inputs, read as "
                     "`data prepare` reads them, and save it as a transformers tokenizer directory for "
                     "`data prepare --tokenizer DIR` (its <|endoftext|> ends each document)."),
    )
    train.add_argument("inputs", nargs="+", metavar="INPUT", help="files, directories or glob patterns")
    train.add_argument("--out", required=True, metavar="DIR", help="the tokenizer directory to write")
    train.add_argument("--vocab-size", type=int, required=True, metavar="N",
                       help="vocabulary size, the 256 bytes and <|endoftext|> included (>= 257)")
    train.add_argument("--min-frequency", type=int, default=2, metavar="N",
                       help="a pair must occur this often to be merged (default 2)")
    _document_options(train)


def _document_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--text-key", default="text", metavar="KEY",
                   help="the JSON field (.jsonl*) or parquet column holding each document's text (default: text)")
    p.add_argument("--skip-bad", action="store_true",
                   help="count and skip bad documents (not JSON, no text field, not UTF-8, null) instead of "
                   "stopping at the first; the count is recorded")


def run(args: argparse.Namespace, ctx: Context) -> int:
    if args.data_command == "prepare":
        return _prepare(args, ctx)
    if args.data_command == "train-tokenizer":
        return _train_tokenizer(args, ctx)
    if args.data_command == "info":
        return _info(args, ctx)
    ctx.err("usage: lmlaunch data {prepare,train-tokenizer,info} ... (see lmlaunch data --help)")
    return ExitCode.USAGE


def _prepare(args: argparse.Namespace, ctx: Context) -> int:
    if args.on_cluster and not args.shipped_corpus:  # the nodes tokenize: this install needs no numpy
        return _on_cluster(args, list(args.inputs), ctx)
    runtime_stack.require("data prepare", ("numpy",) + (("transformers",) if args.tokenizer else ()))
    from lmtrain.data.prepare.build import prepare, shipped_corpus_files

    if args.shipped_corpus and args.inputs:
        raise UserError("give INPUT files or --shipped-corpus, not both")
    if not args.shipped_corpus and not args.inputs:
        raise UserError(
            "nothing to tokenize: give INPUT files, directories or glob patterns (.txt, .jsonl, .jsonl.gz, "
            ".jsonl.zst, .parquet) or --shipped-corpus"
        )
    inputs = shipped_corpus_files() if args.shipped_corpus else args.inputs
    if args.on_cluster:
        return _on_cluster(args, [str(i) for i in inputs], ctx)
    with ctx.working(f"preparing {args.out}: reading {len(inputs)} input(s)") as working:
        result = prepare(inputs, args.out, tokenizer=args.tokenizer, if_missing=args.if_missing,
                         text_key=args.text_key, skip_bad=args.skip_bad,
                         progress=lambda docs, tokens: working.update(
                             f"preparing {args.out}: {docs:,} documents, {tokens:,} tokens in this shard"))
    m = result.meta
    if result.skipped:
        ctx.out(f"ok: {result.out} already holds {m.num_tokens:,} tokens (--if-missing: kept as is)")
        return 0
    ctx.out(
        f"ok: {result.out}: {m.num_documents:,} documents from {len(m.sources)} files -> "
        f"{m.num_tokens:,} tokens ({m.dtype}, vocab_size {m.vocab_size}, eos {m.eos_id}, "
        f"tokenizer {m.tokenizer.get('kind')})"
    )
    _say_skipped(ctx, m.skipped_documents)
    return 0


def _on_cluster(args: argparse.Namespace, inputs: list[str], ctx: Context) -> int:
    if args.if_missing:
        raise UserError("--if-missing is for a local preparation; --on-cluster always prepares")
    from launcher.submit.data_cluster import submit_preparation

    r = submit_preparation(inputs, args.out, tokenizer=args.tokenizer, text_key=args.text_key, skip_bad=args.skip_bad,
                           cluster=args.cluster, tasks=args.tasks, max_parallel=args.max_parallel, name=args.name,
                           partition=args.partition, time_limit=args.time, environ=ctx.environ,
                           array_size=args.array_size)
    ids = r["array_jobs"]
    chain = (f"array job {ids[0]}" if len(ids) == 1 else
             f"array jobs {', '.join(ids)} (at most {r['array_size']} tasks each, each starting when the one before "
             "it ended)")
    ctx.out(f"submitted preparation '{r['run']}': {chain} ({r['tasks']} tasks over {r['files']} "
            f"files, {r['max_parallel']} at once, partition {r['partition']}), then job {r['assemble_job']} writes the "
            f"index and moves {r['staging']} to {r['out']}\n"
            f"run directory: {r['run_dir']}\nnext:\n  lmlaunch status {r['run']}\n  lmlaunch logs {r['run']} --rank K"
            f"   (task K; the final step's log: logs/attempt-1/rank-assemble.log)\n  lmlaunch cancel {r['run']}")
    return 0


def _say_skipped(ctx: Context, skipped: dict | None) -> None:
    if skipped and skipped.get("count"):
        ctx.err(f"warning: --skip-bad: {skipped['count']:,} bad document(s) skipped, e.g. "
                + "; ".join(skipped.get("examples") or []))


def _train_tokenizer(args: argparse.Namespace, ctx: Context) -> int:
    runtime_stack.require("data train-tokenizer", ("tokenizers", "transformers"))
    from lmtrain.data.prepare.tokenizer_train import train_tokenizer

    r = train_tokenizer(args.inputs, args.out, vocab_size=args.vocab_size, text_key=args.text_key,
                        skip_bad=args.skip_bad, min_frequency=args.min_frequency)
    ctx.out(f"ok: {r['out']}: byte-level BPE, vocab_size {r['vocab_size']:,} (eos <|endoftext|> = {r['eos_id']}), "
            f"trained on {r['documents']:,} documents from {r['files']} file(s)\n"
            f"  use it: lmlaunch data prepare INPUT... --tokenizer {r['out']} --out DIR\n"
            f"  and a model for it: model.config.vocab_size: {r['vocab_size']}, eos_token_id: {r['eos_id']}")
    _say_skipped(ctx, r["skipped_documents"])
    return 0


def _info(args: argparse.Namespace, ctx: Context) -> int:
    runtime_stack.require("data info", ("numpy",))
    from lmtrain.data.prepare.build import read_meta

    m = read_meta(args.dir, verify_checksum=args.verify)
    if args.json:
        ctx.out(json.dumps(m.to_json(), indent=2, sort_keys=True))
        return 0
    ctx.out(f"{args.dir}: {m.num_tokens:,} tokens, {m.num_documents:,} documents, {len(m.shards)} shard(s) "
            f"(format version {m.version})")
    ctx.out(f"  dtype {m.dtype}, vocab_size {m.vocab_size}, eos_id {m.eos_id}")
    ctx.out(f"  tokenizer: {json.dumps(m.tokenizer, sort_keys=True)}")
    for s in m.sources:
        skipped = f", {s['skipped']} skipped" if s.get("skipped") else ""
        ctx.out(f"  source {s.get('path')}: {s.get('documents')} documents, {s.get('tokens')} tokens{skipped}")
    if m.skipped_documents:
        ctx.out(f"  skipped documents (--skip-bad): {m.skipped_documents.get('count', 0):,}")
    if args.verify:
        ctx.out(f"  every shard's sha256 verified ({len(m.shards)} file(s), {m.num_tokens * m.itemsize:,} bytes)")
    return 0
