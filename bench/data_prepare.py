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
3. Training data loading, a mixture of 3 stores (weights 0.5/0.3/0.2) against one store of the
   same tokens, each in pairs alternated finely enough that the VM's moving load cancels:
   - the train loader alone (micro batch 8 x 512 tokens: the sampler, the reads and the collation
     a step does, no model), blocks of 50 batches;
   - training steps of jobs/tiny-cpu.yaml's model in one process, alternated step by step between
     the two loaders (each step: fetch, forward, backward, clipping, AdamW);
   - training steps/s of jobs/tiny-cpu.yaml through the real entry (one process, a run per
     measure, its median step time), the same measure end to end but with a run's start between
     the two of a pair.
   Each reports the median pair's ratio (mixture rate over the one store's) and the quartiles.

usage: python bench/data_prepare.py [--copies 16] [--pairs 5] [--loading-pairs 301] [--cluster | --loading-only] [--json]
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
MIXTURE_WEIGHTS = (0.5, 0.3, 0.2)
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
    from lmtrain.data.prepare.build import prepare
    from lmtrain.data.prepare.tokenizer import load_tokenizer
    from lmtrain.data.prepare.tokenizer_train import train_tokenizer

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


def _stores(root: Path) -> None:
    """The shipped corpus's two jsonl files three times in one store (``one``), and once in each
    of three stores (``s0``..``s2``): the mixture and its baseline hold the same tokens."""
    from lmtrain.data.prepare.build import prepare

    corpus = REPO / "data" / "corpus"
    files = [corpus / "licenses.jsonl", corpus / "python-docs.jsonl"]
    if not (root / "one").exists():
        prepare(files * 3, root / "one")
        for i in range(3):
            prepare(files, root / f"s{i}")


def _loaders(root: Path, seq_len: int) -> dict:
    """name -> (the train loader's iterator, its sampler) of the one store and of the mixture."""
    from types import SimpleNamespace

    from lmtrain.data.loader import make_dataloaders

    common = {"seq_len": seq_len, "micro_batch_size": 8, "num_workers": 0, "val_fraction": 0.0}
    specs = {"one": SimpleNamespace(path=str(root / "one"), sources=None, **common),
             "mixture": SimpleNamespace(path=None, sources=[SimpleNamespace(path=str(root / f"s{i}"), weight=w)
                                                            for i, w in enumerate(MIXTURE_WEIGHTS)], **common)}
    out = {}
    for name, spec in specs.items():
        loader, _, sampler = make_dataloaders(spec, world_size=1, rank=0, seed=1, pin_memory=False)
        out[name] = (iter(loader), sampler)
    return out


def _interleaved(measure, pairs: int, clocks: tuple[str, ...] = ("wall", "cpu")) -> dict:
    """``measure(name)`` for the one store and the mixture in ``pairs`` alternated pairs (ABBA:
    neither goes first more often): a pair's two measures share the moment, so the VM's moving
    load cancels in its ratio. Each measure is a time per clock (wall s, CPU s of this process)."""
    rows = []
    for i in range(pairs):
        order = ("one", "mixture") if i % 2 else ("mixture", "one")
        got = {name: measure(name) for name in order}
        rows.append((got["one"], got["mixture"]))
    out = {}
    for j, clock in enumerate(clocks):
        ratios = sorted(o[j] / m[j] for o, m in rows)  # the mixture's rate over the one store's
        out[f"mixture_vs_one_{clock}"] = round(statistics.median(ratios), 4)
        out[f"{clock}_pair_ratio_quartiles"] = [round(ratios[len(ratios) // 4], 3),
                                                 round(ratios[3 * len(ratios) // 4], 3)]
        out[f"{clock}_ratio_of_medians"] = round(statistics.median(o[j] for o, _ in rows)
                                                 / statistics.median(m[j] for _, m in rows), 4)
    out["one_ms"] = round(statistics.median(o[0] for o, _ in rows) * 1e3, 3)
    out["mixture_ms"] = round(statistics.median(m[0] for _, m in rows) * 1e3, 3)
    return out


def bench_loading(root: Path, pairs: int, batches: int = 50) -> dict:
    """The train loader alone (micro batch 8 x 512 tokens: the sampler, the reads and the
    collation of a step, no model): blocks of ``batches`` batches, mixture and one store alternated."""
    _stores(root)
    its = _loaders(root, 512)
    for it, _ in its.values():
        next(it)

    def block(name: str) -> tuple[float, float]:
        it, sampler = its[name]
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(batches):
            next(it)
            sampler.advance()
        return time.perf_counter() - t0, time.process_time() - c0

    out = _interleaved(block, pairs)
    for k in ("one", "mixture"):
        out[f"{k}_samples_per_s"] = round(batches * 8 / out.pop(f"{k}_ms") * 1e3)
    return {"bench": "loading", "pairs": pairs, "batches_per_block": batches, **out}


def bench_steps(root: Path, pairs: int) -> dict:
    """Training steps of jobs/tiny-cpu.yaml's model (micro batch 8 x 128, AdamW, clipping) in one
    process, each step's batch from the mixture's loader or the one store's, alternated step by
    step: the step's time (fetch, forward, backward, optimizer) per loader, median over ``pairs``."""
    import torch
    import yaml

    from lmtrain.model.causal_lm import build_model

    _stores(root)
    its = _loaders(root, 128)
    model = build_model(yaml.safe_load((REPO / "jobs" / "tiny-cpu.yaml").read_text())["model"], seed=1)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)

    def step(name: str) -> tuple[float, float]:
        it, sampler = its[name]
        t0, c0 = time.perf_counter(), time.process_time()
        batch = next(it)
        sampler.advance()
        model(input_ids=batch["input_ids"], labels=batch["labels"]).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, time.process_time() - c0

    _interleaved(step, 3)  # warm-up
    out = _interleaved(step, pairs)
    for k in ("one", "mixture"):
        out[f"{k}_steps_per_s"] = round(1e3 / out.pop(f"{k}_ms"), 2)
    return {"bench": "steps-interleaved", "pairs": pairs, **out}


def bench_training(root: Path, pairs: int, steps: int = 60) -> dict:
    """Training steps/s of jobs/tiny-cpu.yaml (one process, through the real entry) on a mixture of
    the three stores against the one store of the same tokens: the loader inside a real step.
    A run's rate is 1 / its median step time (its heartbeats, steps >= 10): a stolen moment moves
    one step, not the rate."""
    import yaml

    from launcher.submit.local_run import prepare_local_run
    from lmcore.jsonlines import read_jsonl
    from lmtrain.local.launch import launch

    _stores(root)
    base = yaml.safe_load((REPO / "jobs" / "tiny-cpu.yaml").read_text())
    specs = {}
    for kind in ("one", "mixture"):
        spec = json.loads(json.dumps(base))
        if kind == "mixture":
            spec["data"].pop("path")
            spec["data"]["sources"] = [{"path": str(root / f"s{i}"), "weight": w} for i, w in enumerate(MIXTURE_WEIGHTS)]
        else:
            spec["data"]["path"] = str(root / "one")
        specs[kind] = root / f"train-{kind}.yaml"
        specs[kind].write_text(yaml.safe_dump(spec))
    env = {**os.environ, "LMLAUNCH_RUNS_ROOT": str(root / "train-runs")}
    overrides = ["trainer.val_check_interval=null", "trainer.limit_val_batches=0", "trainer.log_every_n_steps=1",
                 "checkpoint.every_n_steps=1000", "data.val_fraction=0.0"]

    def step_time(kind: str) -> tuple[float]:
        plan = prepare_local_run(str(specs[kind]), overrides, devices=1, max_steps=steps, name=f"train-{kind}",
                                 environ=env, new=True, say=lambda m: None)
        if launch(plan.paths.run_dir, 1, plan_env=plan.env, out=io.StringIO(), threads_per_proc=2) != 0:
            raise SystemExit(f"the {kind} training run failed; logs in {plan.paths.run_dir}/logs")
        times = [b["time"] for b in read_jsonl(plan.paths.heartbeat) if b.get("event") == "step" and b.get("step", 0) >= 10]
        return (statistics.median(b - a for a, b in zip(times, times[1:])),)

    out = _interleaved(step_time, pairs, clocks=("wall",))  # the ranks' CPU clock is not read here
    for k in ("one", "mixture"):
        out[f"{k}_steps_per_s"] = round(1e3 / out.pop(f"{k}_ms"), 2)
    return {"bench": "training-real-entry", "pairs": pairs, "steps": steps, **out}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--copies", type=int, default=16, help="the shipped corpus this many times (default 16: ~19 MB)")
    ap.add_argument("--pairs", type=int, default=5, help="bare/prepare pairs alternated; the median pair's ratio")
    ap.add_argument("--loading-pairs", type=int, default=301,
                    help="mixture/one-store pairs of loader blocks and of training steps (default 301)")
    ap.add_argument("--cluster", action="store_true", help="also prepare on the local cluster with 1, 2, 4 tasks")
    ap.add_argument("--loading-only", action="store_true", help="only part 3: loading a mixture")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        root = Path(tmp)
        rows = []
        if not args.loading_only:
            rows.append(bench_prepare(root, args.copies, args.pairs))
            if args.cluster:
                rows += bench_cluster(root, rows[0]["corpus"], rows[0]["tokenizer"])
        rows.append(bench_loading(root, args.loading_pairs))
        rows.append(bench_steps(root, args.loading_pairs))
        rows.append(bench_training(root, args.pairs))
    for r in rows:
        r.pop("corpus", None)
        r.pop("tokenizer", None)
        print(json.dumps(r) if args.json else "  ".join(f"{k}={v}" for k, v in r.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
