"""The GPU section of bench/RESULTS.md from one run of bench/gpu_session.sh: every figure of the
GPU goals' table against its goal, with the date, the GPU, the versions and the commit measured.

    python bench/gpu_report.py OUT_DIR [--commit SHA] [--append bench/RESULTS.md]
                               [--profiles-to bench/gpu-profiles]

OUT_DIR is what the device call brought back: ``device.txt``, ``throughput.jsonl``,
``ckpt.jsonl``, ``profile/top-*.json`` and ``logs-*.tgz`` (the steps' logs). Without ``--append``
the section is printed. ``--profiles-to`` keeps the profiles' top operators in the repository
(the second lease's FSDP2 rows were lost because only the summary was kept). A figure that the
run did not produce is written as "not measured", with the step's last log line where there is
one: nothing is guessed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tarfile
from pathlib import Path
from typing import Any

# (throughput config, gpu_session.sh's step, what the ratio compares, goal): the GPU goals
RATIOS = (
    ("gpt2-124m", "tp-gpt2", "GPT-2 124M, project path / compiled hand loop", 1.00),
    ("llama-1b", "tp-llama", "Llama 1.1B, project path / compiled hand loop", 1.00),
    ("fsdp", "tp-fsdp", "FSDP2 / DDP, GPT-2 124M", 0.95),
    ("zero2", "tp-zero2", "ZeRO-2 / DDP, GPT-2 124M", 0.95),
)
GOAL_HELD_S = 2.0  # the 1B stop checkpoint: training held at most 2 s
GOAL_DURABLE_TO_DD = 1.1


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def _logs(out: Path) -> dict[str, str]:
    """Each step's log (NAME.log) from the archives the session wrote, or left beside them."""
    logs = {p.stem: p.read_text(errors="replace") for p in out.glob("*.log")}
    for archive in sorted(out.glob("logs-*.tgz")):
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                name = Path(member.name).name
                if member.isfile() and name.endswith((".log", ".txt")):
                    f = tar.extractfile(member)
                    if f is not None:
                        logs[Path(name).stem] = f.read().decode(errors="replace")
    return logs


def _last_line(text: str | None) -> str:
    lines = [x for x in (text or "").splitlines() if x.strip()]
    return lines[-1][:160] if lines else "no log"


def _met(value: float | None, goal: float, *, at_least: bool) -> str:
    if value is None:
        return "not measured"
    ok = value >= goal if at_least else value <= goal
    return "met" if ok else "**not met**"


def section(out: Path, commit: str) -> str:
    logs = _logs(out)
    device = (out / "device.txt").read_text().strip() if (out / "device.txt").is_file() else logs.get("device", "?")
    tput = {x["config"]: x for x in _jsonl(out / "throughput.jsonl") if "config" in x}
    ckpts = {x["config"]: x for x in _jsonl(out / "ckpt.jsonl") if "config" in x}
    dates = sorted(x["date"] for x in [*tput.values(), *ckpts.values()] if x.get("date"))
    when = dates[0][:10] if dates else "date unknown"
    gpu = device.splitlines()[0] if device else "GPU unknown"
    rows = ["| figure | measured | goal | |", "| --- | --- | --- | --- |"]
    for config, step, what, goal in RATIOS:
        line = tput.get(config)
        if line is None or "ratio" not in line:
            why = line.get("error") if line else _last_line(logs.get(step))
            rows.append(f"| {what} | not measured ({why}) | >= {goal:.2f} | not measured |")
            continue
        pairs = ", ".join(f"{p:.3f}" for p in line.get("ratio_pairs", []))
        rows.append(f"| {what} | **{line['ratio']:.3f}** (pairs {pairs}; {line['tokens_per_s_b'] / 1e3:.1f}k vs "
                    f"{line['tokens_per_s_a'] / 1e3:.1f}k tokens/s) | >= {goal:.2f} | "
                    f"{_met(line['ratio'], goal, at_least=True)} |")
    syncs = (tput.get("gpt2-124m") or {}).get("b", {}).get("host_syncs")
    if syncs:
        where = "; ".join(f"{n}x {w}" for w, n in (syncs.get("where") or {}).items()) or "-"
        rows.append(f"| host syncs on non-logging steps (GPT-2, project path) | **{syncs['non_logging_steps']}** "
                    f"of {syncs['total']} (where: {where}) | 0 | {_met(syncs['non_logging_steps'], 0, at_least=False)} |")
    else:
        rows.append("| host syncs on non-logging steps | not measured | 0 | not measured |")
    ck = ckpts.get("llama-1b")
    if ck is not None and "held_s" in ck:
        ratio = ck["save_s"] / ck["dd_s"]
        rows.append(f"| 1B ZeRO-2 stop checkpoint, training held | **{ck['held_s']:.2f} s** of {ck['save_s']:.2f} s "
                    f"({ck['checkpoint_bytes'] / 1e9:.2f} GB) | <= {GOAL_HELD_S:.0f} s | "
                    f"{_met(ck['held_s'], GOAL_HELD_S, at_least=False)} |")
        rows.append(f"| 1B ZeRO-2 stop checkpoint, durable / dd | **{ratio:.2f}x** ({ck['save_s']:.2f} s against "
                    f"{ck['dd_s']:.2f} s) | <= {GOAL_DURABLE_TO_DD}x | {_met(ratio, GOAL_DURABLE_TO_DD, at_least=False)} |")
    else:
        rows.append(f"| 1B ZeRO-2 stop checkpoint | not measured ({_last_line(logs.get('ck-llama'))}) | held <= 2 s, "
                    f"durable <= 1.1x dd | not measured |")
    tests = logs.get("gpu-tests")
    summary = next((x for x in reversed((tests or "").splitlines()) if " passed" in x or " failed" in x), None)
    said = summary.strip("= ") if summary else _test_counts(tests) or _last_line(tests)
    rows.append(f"| GPU tests (`pytest -m gpu tests/gpu`) | {said} | "
                f"all pass | {'met' if summary and 'failed' not in summary and 'error' not in summary else 'not met'} |")
    profiles = sorted((out / "profile").glob("top-*.json")) if (out / "profile").is_dir() else []
    lines = [
        f"## GPU: {gpu} (measured {when}, commit {commit}, `bench/gpu_session.sh`)",
        "",
        f"Device and versions: {' / '.join(device.splitlines())}. Ratios: the median of the alternated pairs, "
        "both sides in one process (bench/throughput.py). Written by `python bench/gpu_report.py`.",
        "",
        *rows,
        "",
    ]
    if profiles:
        lines.append("Profiles kept (top operators by CUDA self time): "
                     + ", ".join(f"`bench/gpu-profiles/{p.name}`" for p in profiles) + ".")
        lines.append("")
    return "\n".join(lines)


def _test_counts(log: str | None) -> str | None:
    """A `pytest -v` log cut before its summary (the step's cap): each test's outcome as far as it got,
    failed ones named (their messages come only in the summary)."""
    import re

    lines = (log or "").splitlines()
    total = next((int(m.group(1)) for x in lines if (m := re.search(r"(?:collected|\[)\s*(\d+) items", x))), None)
    outcome: dict[str, str] = {}
    for x in lines:
        m = re.search(r"(\S+::\S+(?:\[[^\]]*\])?)\s+(PASSED|FAILED|ERROR|SKIPPED)\b", x) or re.search(
            r"\b(PASSED|FAILED|ERROR|SKIPPED)\s+(\S+::\S+)", x)
        if m:
            test, result = (m.group(1), m.group(2)) if "::" in m.group(1) else (m.group(2), m.group(1))
            outcome[test] = result
    if not outcome:
        return None
    counts = {r: sum(1 for v in outcome.values() if v == r) for r in ("PASSED", "FAILED", "ERROR", "SKIPPED")}
    said = ", ".join(f"{n} {r.lower()}" for r, n in counts.items() if n)
    if total is not None and total > len(outcome):
        said += f", {total - len(outcome)} not reached (cut before pytest's summary)"
    failed = [t.split("::")[-1] for t, r in outcome.items() if r in ("FAILED", "ERROR")]
    return said + (f"; failed: {', '.join(failed)}" if failed else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="what bench/gpu_session.sh wrote ($OUT)")
    p.add_argument("--commit", default="unknown", help="the commit the device ran")
    p.add_argument("--append", type=Path, default=None, help="append the section to this file (bench/RESULTS.md)")
    p.add_argument("--profiles-to", type=Path, default=None, help="copy profile/top-*.json here")
    a = p.parse_args(argv)
    if not a.out.is_dir():
        p.error(f"{a.out} is not a directory")
    text = section(a.out, a.commit)
    if a.profiles_to is not None and (a.out / "profile").is_dir():
        a.profiles_to.mkdir(parents=True, exist_ok=True)
        for f in sorted((a.out / "profile").glob("top-*.json")):
            shutil.copy2(f, a.profiles_to / f.name)
    if a.append is not None:
        with open(a.append, "a") as f:
            f.write("\n" + text)
        print(f"appended the GPU section to {a.append}", file=sys.stderr)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
