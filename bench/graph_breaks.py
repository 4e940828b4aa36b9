"""Graph breaks and recompiles of the project's compiled training step on CPU, with their reasons,
against a plain compiled loop of the same model (the reference: torch.compile of the whole model,
as bench/handwritten_loop.py compiles it on CUDA).

For each model (the tiny GPT-2 of jobs/tiny-cpu.yaml, the tiny Llama of jobs/tiny-cpu-pp.yaml)
and strategy (DDP, FSDP2), the project's path runs as a user runs it: ``lmlaunch run --local``
with ``model.compile=true`` (each transformer block compiled in place, and the loss), 2 ranks on
gloo, ``--steps`` optimizer steps, Lightning's sanity validation included. dynamo reports its own
graph breaks and recompiles through ``TORCH_LOGS=graph_breaks,recompiles``; every rank's log is
read back and each event counted once per rank, with its reason (the recompile's failed guard).

    python bench/graph_breaks.py                 # 4 project runs and 2 references, about 4 minutes here
    python bench/graph_breaks.py --steps 20 --out bench/graph_breaks.jsonl

Prints one JSON line per run, then a table. The goal (the GPU issue's CPU part): 0 graph breaks
and at most 1 recompile per compiled function over 20 steps, as the reference.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LMLAUNCH = Path(sys.executable).parent / "lmlaunch"

MODELS = {
    "gpt2": ("jobs/tiny-cpu.yaml", []),
    "llama": ("jobs/tiny-cpu-pp.yaml", ["trainer.pipeline_parallel_size=1", "data.micro_batch_size=8"]),
}
STRATEGIES = {"ddp": ["trainer.strategy=ddp"], "fsdp": ["trainer.strategy=fsdp"]}

BREAK = re.compile(r"^Graph break (?:in user code )?(?:at )?(.*)$")
RECOMPILE = re.compile(r"Recompiling function (\S+) in (\S+)")
GUARD = re.compile(r"^\s*- \d+/\d+: (.*)$")


def dynamo_events(text: str) -> dict[str, collections.Counter[str]]:
    """``TORCH_LOGS=graph_breaks,recompiles`` output -> graph breaks by reason, recompiles by
    function and failed guard."""
    breaks: collections.Counter[str] = collections.Counter()
    recompiles: collections.Counter[str] = collections.Counter()
    lines = [re.sub(r"^.*?\] (\[[^]]*\] )?(\[__\w+\] )?", "", line) for line in dict.fromkeys(text.splitlines())]
    for i, line in enumerate(lines):
        if m := BREAK.match(line.strip()):
            after = [x.strip() for x in lines[i + 1:i + 8]]
            why = next((x.removeprefix("Explanation: ") for x in after if x.startswith("Explanation:")), None) or next(
                (x.split("Graph Break Reason:", 1)[1].strip() for x in after if "Graph Break Reason:" in x), "?")
            breaks[f"{m.group(1).strip()}: {why}"[:200]] += 1
        elif m := RECOMPILE.search(line):
            guard = next((g.group(1).strip() for g in map(GUARD.match, lines[i + 1:i + 6]) if g), "?")
            recompiles[f"{m.group(1)} ({Path(m.group(2)).name}): {guard}"] += 1
    return {"graph_breaks": breaks, "recompiles": recompiles}


def project_run(model: str, strategy: str, steps: int, root: Path) -> dict[str, object]:
    spec, extra = MODELS[model]
    name = f"gb-{model}-{strategy}"
    env = {**os.environ, "TORCH_LOGS": "graph_breaks,recompiles", "LMLAUNCH_RUNS_ROOT": str(root)}
    argv = [str(LMLAUNCH), "run", spec, "--local", "--devices", "2", "--max-steps", str(steps), "--name", name,
            "--new", "model.compile=true", *extra, *STRATEGIES[strategy]]
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    logs = sorted((root / name / "logs").rglob("rank-*.out")) + sorted((root / name / "logs").rglob("node-*.log"))
    text = proc.stdout + proc.stderr + "".join(p.read_text(errors="replace") for p in logs)
    per_rank = {f"rank{r}": dynamo_events("\n".join(line for line in text.splitlines() if f"[rank{r}]" in line))
                for r in (0, 1)}
    return {"path": "project", "model": model, "strategy": strategy, "steps": steps, "exit": proc.returncode,
            **{k: {r: dict(v[k]) for r, v in per_rank.items()} for k in ("graph_breaks", "recompiles")}}


REFERENCE = r"""
import sys, torch
sys.path[:0] = [sys.argv[3]]
from lmcore.job.spec import JobSpec
from launcher.spec.jobfile import load_job
from lmtrain.model.causal_lm import build_model
spec = load_job(sys.argv[1], sys.argv[4:])
model = torch.compile(build_model(spec.model, seed=1234))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
torch.manual_seed(0)
for step in range(int(sys.argv[2])):
    x = torch.randint(0, spec.model.config["vocab_size"], (spec.data.micro_batch_size, spec.data.seq_len))
    model(x, labels=x).loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step(); opt.zero_grad(set_to_none=True)
"""


def reference_run(model: str, steps: int) -> dict[str, object]:
    spec, extra = MODELS[model]
    env = {**os.environ, "TORCH_LOGS": "graph_breaks,recompiles"}
    proc = subprocess.run([sys.executable, "-c", REFERENCE, spec, str(steps), str(REPO / "src"), *extra], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=1800)
    ev = dynamo_events(proc.stdout + proc.stderr)
    return {"path": "reference", "model": model, "strategy": "one process", "steps": steps, "exit": proc.returncode,
            "graph_breaks": {"rank0": dict(ev["graph_breaks"])}, "recompiles": {"rank0": dict(ev["recompiles"])},
            **({"stderr": proc.stderr[-600:]} if proc.returncode else {})}


def table(rows: list[dict[str, object]]) -> str:
    out = ["| path | model | strategy | exit | graph breaks (rank 0) | recompiles (rank 0) | reasons |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        b, c = r["graph_breaks"]["rank0"], r["recompiles"]["rank0"]  # type: ignore[index]
        reasons = "; ".join(f"{n}x {k}" for k, n in {**b, **c}.items()) or "-"
        out.append(f"| {r['path']} | {r['model']} | {r['strategy']} | {r['exit']} | {sum(b.values())} | "
                   f"{sum(c.values())} | {reasons} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--models", default="gpt2,llama")
    ap.add_argument("--strategies", default="ddp,fsdp")
    ap.add_argument("--out", help="append the JSON lines here too")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="graph-breaks-") as root:
        for model in args.models.split(","):
            rows.append(reference_run(model, args.steps))
            for strategy in args.strategies.split(","):
                rows.append(project_run(model, strategy, args.steps, Path(root)))
            for row in rows[-1 - len(args.strategies.split(",")):]:
                print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print(table(rows))
    return 0 if all(r["exit"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
