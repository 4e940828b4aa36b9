"""Real-corpus preparation and mixture loading, each as a ratio to a baseline measured in the same run.

1. ``prepare`` throughput of one process against the same tokenizer's bare ``encode_batch`` over
   the same documents (already in memory: no reading, no writing), and against the byte-level
   path: a BPE tokenizer trained here on the shipped corpus (``data train-tokenizer``), the corpus
   split into .jsonl.zst, parquet and .jsonl.gz files and repeated ``--copies`` times. The two
   are run in alternated pairs and the median pair's ratio reported: this machine's CPU is shared
   (its steal time moves a lone timing by 50 %), a pair's two runs share the moment.
2. ``--cluster``: the same preparation on the local cluster (``data prepare --on-cluster``) with
   1, 2 and 4 array tasks: wall time from submission to the index written, and the speedup
   against one task (this machine has 2 cores and both nodes share them: report what it allows).
3. Training data loading: samples/s of the train loader (micro batch 8 x 512 tokens, the
   sampler and the collation a step does, no model) reading a mixture of 3 stores against one
   store of the same data.

usage: python bench/data_prepare.py [--copies 8] [--cluster] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "src"))


def _corpus(root: Path, copies: int) -> tuple[Path, list[str]]:
    from tests.unit.test_corpus_inputs import shipped_documents, write

    docs = shipped_documents() * copies
    d = root / "corpus"
    d.mkdir()
    kinds = [".jsonl.zst", ".parquet", ".jsonl.gz"]
    n = len(docs)
    for i in range(12):
        write(d / f"part-{i:02d}{kinds[i % 3]}", docs[i * n // 12:(i + 1) * n // 12])
    return d, docs


def bench_prepare(root: Path, copies: int, reps: int) -> dict:
    from lmtrain.prepare import prepare
    from lmtrain.tokenizer import load_tokenizer
    from lmtrain.tokenizer_train import train_tokenizer

    corpus, docs = _corpus(root, copies)
    train_tokenizer([corpus], root / "tok", vocab_size=4096)
    tok = load_tokenizer(root / "tok")
    chars = sum(len(d) for d in docs)
    pairs, bytes_ = [], []
    for _ in range(reps):  # alternated pairs: the machine's load moves, and a pair shares it
        t0 = time.perf_counter()
        ids = [len(x) for i in range(0, len(docs), 1024) for x in tok.encode_batch(docs[i:i + 1024])]
        bare = time.perf_counter() - t0
        t0 = time.perf_counter()
        meta = prepare([corpus], root / "bpe", tokenizer=root / "tok").meta
        pairs.append((bare, time.perf_counter() - t0))
        t0 = time.perf_counter()
        prepare([corpus], root / "bytes")
        bytes_.append(time.perf_counter() - t0)
    assert meta.num_tokens == sum(ids) + len(docs)  # the same ids (and one eos per document)
    ratio = statistics.median(b / f for b, f in pairs)
    bare, full = statistics.median(b for b, _ in pairs), statistics.median(f for _, f in pairs)
    return {"bench": "prepare", "documents": len(docs), "mb_text": round(chars / 1e6, 2), "tokens": meta.num_tokens,
            "pairs": reps, "bare_encode_batch_s": round(bare, 3), "prepare_s": round(full, 3),
            "prepare_bytes_s": round(statistics.median(bytes_), 3),
            "prepare_vs_bare_throughput": round(ratio, 3), "pair_ratios": [round(b / f, 3) for b, f in pairs],
            "bpe_vs_bytes_time": round(full / statistics.median(bytes_), 3),
            "tokens_per_s": round(meta.num_tokens / full), "corpus": str(corpus), "tokenizer": str(root / "tok")}


def bench_cluster(root: Path, corpus: str, tokenizer: str) -> list[dict]:
    env = {**os.environ, "LMLAUNCH_RUNS_ROOT": str(root / "runs"), "LMLAUNCH_HOME": str(root / "home")}
    out = []
    for tasks in (1, 2, 4):
        t0 = time.time()
        r = subprocess.run([sys.executable, "-m", "launcher.cli", "data", "prepare", corpus, "--tokenizer", tokenizer,
                            "--out", str(root / f"cl{tasks}"), "--on-cluster", "--tasks", str(tasks),
                            "--max-parallel", str(tasks), "--name", f"bench-prep-{tasks}"],
                           env=env, capture_output=True, text=True, check=True)
        assemble = re.search(r"then job (\d+) writes", r.stdout).group(1)
        while (root / "runs" / f"bench-prep-{tasks}" / "DONE").exists() is False:
            state = subprocess.run(["sacct", "-X", "-n", "-o", "State", "-j", assemble], capture_output=True,
                                   text=True).stdout.split()
            if state and state[0] in ("FAILED", "CANCELLED", "TIMEOUT"):
                raise SystemExit(f"the preparation with {tasks} task(s) ended {state[0]}")
            time.sleep(0.5)
        out.append({"bench": "prepare-on-cluster", "tasks": tasks, "wall_s": round(time.time() - t0, 1)})
    for row in out:
        row["speedup_vs_1_task"] = round(out[0]["wall_s"] / row["wall_s"], 2)
    return out


def bench_loading(root: Path, reps: int) -> dict:
    from types import SimpleNamespace

    from lmtrain.data import make_dataloaders
    from lmtrain.prepare import prepare

    corpus = REPO / "data" / "corpus"
    files = [corpus / "licenses.jsonl", corpus / "python-docs.jsonl"]
    one = prepare(files * 3, root / "one").out  # the same tokens as the three stores together
    thirds = [prepare(files, root / f"s{i}").out for i in range(3)]
    common = {"seq_len": 512, "micro_batch_size": 8, "num_workers": 0, "val_fraction": 0.0}
    single = SimpleNamespace(path=str(one), sources=None, **common)
    mixture = SimpleNamespace(path=None, sources=[SimpleNamespace(path=str(p), weight=w) for p, w in
                                                  zip(thirds, (0.5, 0.3, 0.2))], **common)

    def rate(spec: SimpleNamespace, n: int = 300) -> float:
        loader, _, sampler = make_dataloaders(spec, world_size=1, rank=0, seed=1, pin_memory=False)
        it = iter(loader)
        next(it)
        t0 = time.perf_counter()
        for _ in range(n):
            next(it)
            sampler.advance()
        return n * 8 / (time.perf_counter() - t0)

    pairs = [(rate(single), rate(mixture)) for _ in range(reps)]  # alternated: a pair shares the machine's load
    ratio = statistics.median(m / o for o, m in pairs)
    return {"bench": "loading", "pairs": reps, "one_store_samples_per_s": round(statistics.median(o for o, _ in pairs)),
            "mixture_samples_per_s": round(statistics.median(m for _, m in pairs)), "mixture_vs_one": round(ratio, 3),
            "pair_ratios": [round(m / o, 3) for o, m in pairs]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--copies", type=int, default=16, help="the shipped corpus this many times (default 16: ~19 MB)")
    ap.add_argument("--pairs", type=int, default=5, help="bare/prepare pairs alternated; the median pair's ratio")
    ap.add_argument("--cluster", action="store_true", help="also prepare on the local cluster with 1, 2, 4 tasks")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        root = Path(tmp)
        rows = [bench_prepare(root, args.copies, args.pairs)]
        if args.cluster:
            rows += bench_cluster(root, rows[0]["corpus"], rows[0]["tokenizer"])
        rows.append(bench_loading(root, 41))
    for r in rows:
        r.pop("corpus", None)
        r.pop("tokenizer", None)
        print(json.dumps(r) if args.json else "  ".join(f"{k}={v}" for k, v in r.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
