"""The equivalence matrix in full: every way to scale against DDP, for more architectures and
precisions than the suite runs (tests/equivalence.py: the harness, its settings and tolerances;
tests/unit/test_equivalence_matrix.py: the suite's cells, fp32, GPT-2 and Llama).

Each cell trains the same model on the same data for 8 steps through the real entry with the
shipped specs' clipping (1.0, hit), accumulation 2, weight decay, warmup and cosine, dropout off,
and is compared with DDP on 2 ranks trained in the same run: the largest relative difference of a
step's loss and gradient norm, the largest of any final weight (read as export reads it), and the
update's (the weights' distance from DDP's against DDP's distance from the initial weights). Printed as a
markdown table (bench/RESULTS.md keeps the last one); exit 1 when a cell is off its tolerance or
fails where the planner accepted it.

- models: gpt2 (tied head, learned positions), llama (untied), qwen2 tied (a tied head with a
  tensor-parallel plan), gpt_neox (partial rotary, parallel residual), opt (learned positions
  called with the mask, a tied head);
- precisions: 32-true, and bf16-mixed (each strategy's own autocast or casts, its own tolerance);
- layouts: tests/equivalence.py's LAYOUTS (3D with data parallelism, dp2 x tp2 x pp2, needs 8 ranks:
  beyond the local profile's 4 a node; tp2xpp2 is its dp1 form).

usage: python bench/equivalence.py [--models gpt2,llama] [--precisions 32-true,bf16-mixed]
                                   [--layouts fsdp2,zero3] [--json OUT]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "src"), str(REPO / "tests"), str(REPO / "tests" / "unit")]

from tests import equivalence as eq


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2,llama,qwen2,gpt_neox,opt")
    ap.add_argument("--precisions", default="32-true,bf16-mixed")
    ap.add_argument("--layouts", default=",".join(x for x in eq.LAYOUTS if x != "ddp"))
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args()
    rows: list[eq.Row] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lmlaunch-equivalence-") as tmp:
        os.environ["LMLAUNCH_RUNS_ROOT"] = str(Path(tmp) / "runs")
        for model in args.models.split(","):
            for precision in args.precisions.split(","):
                ref = eq.train(model, "ddp", Path(tmp), precision)
                if isinstance(ref, str):
                    print(f"{model} {precision}: DDP refused: {ref}", file=sys.stderr)
                    continue
                initial = eq.initial_weights(model, Path(tmp))
                for layout in args.layouts.split(","):
                    t = time.perf_counter()
                    try:
                        got: eq.Trained | str = eq.train(model, layout, Path(tmp), precision)
                    except RuntimeError as exc:  # accepted by the planner, then failed: a defect
                        got = eq.Trained(layout, "", {}, {})
                        row = eq.Row(model, layout, precision, said=f"FAILED: {str(exc).splitlines()[0]}")
                    else:
                        row = eq.compare(model, layout, ref, got, precision, initial)
                    rows.append(row)
                    figures = " ".join("-" if v is None else f"{v:.1e}" for v in (row.loss, row.norm, row.weight, row.update))
                    print(f"{model:9s} {precision:10s} {layout:16s} {time.perf_counter() - t:5.1f} s {figures} "
                          f"{'ok' if row.ok() else row.said[:90] or 'OFF'}", file=sys.stderr, flush=True)
    print(eq.table(rows))
    failed = [r for r in rows if r.said.startswith("FAILED") or (not r.said and not r.ok())]
    print(f"\n{len(rows)} cells in {time.perf_counter() - started:.0f} s: {sum(r.ok() for r in rows)} within "
          f"tolerance, {sum(bool(r.said) and not r.said.startswith('FAILED') for r in rows)} refused by the planner, "
          f"{len(failed)} off or failed")
    if args.json:
        Path(args.json).write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
