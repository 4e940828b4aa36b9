"""Real-corpus preparation and mixture loading, each as a ratio to a baseline measured in the same run.

1. ``prepare`` throughput of one process against the same tokenizer's bare ``encode_batch`` over
   the same documents (already in memory: no reading, no writing), and against the byte-level
   path: a BPE tokenizer trained here on the shipped corpus (``data train-tokenizer``), the corpus
   split into .jsonl.zst, parquet and .jsonl.gz files and repeated ``--copies`` times. The two
   are run in alternated pairs and the median pair's ratio reported: this machine's CPU is shared
   (its steal time moves a lone timing by 50 %), a pair's two runs share the moment.
2. ``--cluster``: the same preparation on the local cluster (``data prepare --on-cluster``) with
   1, 2 and 4 array tasks: wall time from submission to the index written, and the speedup
   against one task, and each task's own tokens/s (from its log; this machine has 2 cores and both
   nodes share them: report what it allows).
3. Training data loading: samples/s of the train loader (micro batch 8 x 512 tokens, the
   sampler and the collation a step does, no model) reading a mixture of 3 stores against one
   store of the same tokens; and training steps/s of jobs/tiny-cpu.yaml (one process, the real
   entry) on the mixture against the one store.

usage: python bench/data_prepare.py [--copies 8] [--cluster] [--json]
"""

from __future__ import annotations

import argparse
import io
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
        wall = round(time.time() - t0, 1)
        rates = []  # each task's own rate, from its log: "task K done: N shards (T tokens) in S s"
        for log in sorted((root / "runs" / f"bench-prep-{tasks}" / "logs").glob("attempt-*/rank-[0-9]*.log")):
            m = re.search(r"task \d+ done: \d+ shards \((\d+) tokens\) in ([\d.]+) s", log.read_text())
            if m:
                rates.append(int(m.group(1)) / max(float(m.group(2)), 1e-3))
        out.append({"bench": "prepare-on-cluster", "tasks": tasks, "wall_s": wall,
                    "per_task_tokens_per_s": round(statistics.mean(rates)) if rates else None})
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

    def rate(spec: SimpleNamespace, n: int = 300) -> tuple[float, float]:
        """(samples per wall second, samples per CPU second of this process): the loader is one
        thread (no workers), and the CPU time leaves out what the VM's neighbours stole."""
        loader, _, sampler = make_dataloaders(spec, world_size=1, rank=0, seed=1, pin_memory=False)
        it = iter(loader)
        next(it)
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            next(it)
            sampler.advance()
        return n * 8 / (time.perf_counter() - t0), n * 8 / (time.process_time() - c0)

    pairs = [(rate(single), rate(mixture)) for _ in range(reps)]  # alternated: a pair shares the machine's load
    wall = [m[0] / o[0] for o, m in pairs]
    cpu = [m[1] / o[1] for o, m in pairs]
    return {"bench": "loading", "pairs": reps, "one_store_samples_per_s": round(statistics.median(o[0] for o, _ in pairs)),
            "mixture_samples_per_s": round(statistics.median(m[0] for _, m in pairs)),
            "mixture_vs_one": round(statistics.median(wall), 3),
            "mixture_vs_one_cpu_time": round(statistics.median(cpu), 3),
            "cpu_pair_ratio_spread": [round(min(cpu), 3), round(max(cpu), 3)],
            "pair_ratios": [round(x, 3) for x in wall]}


def bench_training(root: Path, pairs: int, steps: int = 60) -> dict:
    """Training steps/s of jobs/tiny-cpu.yaml (one process, through the real entry) on a mixture of
    the three stores against the one store of the same tokens: the loader inside a real step."""
    import yaml

    from launcher.commands.run import prepare_local_run
    from launcher.core.jsonlines import read_jsonl
    from lmtrain.local import launch

    base = yaml.safe_load((REPO / "jobs" / "tiny-cpu.yaml").read_text())
    specs = {}
    for kind in ("one", "mixture"):
        spec = json.loads(json.dumps(base))
        if kind == "mixture":
            spec["data"].pop("path")
            spec["data"]["sources"] = [{"path": str(root / f"s{i}"), "weight": w} for i, w in enumerate((0.5, 0.3, 0.2))]
        else:
            spec["data"]["path"] = str(root / "one")
        specs[kind] = root / f"train-{kind}.yaml"
        specs[kind].write_text(yaml.safe_dump(spec))
    env = {**os.environ, "LMLAUNCH_RUNS_ROOT": str(root / "train-runs")}
    overrides = ["trainer.val_check_interval=null", "trainer.limit_val_batches=0", "trainer.log_every_n_steps=1",
                 "checkpoint.every_n_steps=1000", "data.val_fraction=0.0"]

    def steps_per_s(kind: str) -> float:
        plan = prepare_local_run(str(specs[kind]), overrides, devices=1, max_steps=steps, name=f"train-{kind}",
                                 environ=env, new=True, say=lambda m: None)
        if launch(plan.paths.run_dir, 1, plan_env=plan.env, out=io.StringIO(), threads_per_proc=2) != 0:
            raise SystemExit(f"the {kind} training run failed; logs in {plan.paths.run_dir}/logs")
        beats = [b for b in read_jsonl(plan.paths.heartbeat) if b.get("event") == "step" and b.get("step", 0) >= 10]
        return (beats[-1]["step"] - beats[0]["step"]) / (beats[-1]["time"] - beats[0]["time"])

    rows = [(steps_per_s("one"), steps_per_s("mixture")) for _ in range(pairs)]  # alternated pairs
    return {"bench": "training", "pairs": pairs, "steps": steps,
            "one_store_steps_per_s": round(statistics.median(o for o, _ in rows), 2),
            "mixture_steps_per_s": round(statistics.median(m for _, m in rows), 2),
            "mixture_vs_one": round(statistics.median(m / o for o, m in rows), 3),
            "pair_ratios": [round(m / o, 3) for o, m in rows]}


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
        rows.append(bench_training(root, args.pairs))
    for r in rows:
        r.pop("corpus", None)
        r.pop("tokenizer", None)
        print(json.dumps(r) if args.json else "  ".join(f"{k}={v}" for k, v in r.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
