"""A run's report: loss and tokens/s against step and wall time, each preemption/requeue marked
(vertical lines), and a short text summary. matplotlib is imported only when a PNG is drawn."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from launcher.monitor.slurm_view import format_duration

FIGSIZE_IN = (12.0, 7.0)
DPI = 100  # -> a 1200 x 700 pixel PNG


@dataclass
class Stop:
    """Where an attempt ended and the next began (a vertical line on the plots)."""

    attempt: int
    step: int | None
    time: float | None
    reason: str


@dataclass
class ReportData:
    name: str
    steps: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # epoch seconds of each step line
    loss: list[float | None] = field(default_factory=list)
    tokens_per_s: list[float | None] = field(default_factory=list)
    val_steps: list[int] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    stops: list[Stop] = field(default_factory=list)
    summary: list[str] = field(default_factory=list)
    eval: list[dict[str, Any]] = field(default_factory=list)  # the evaluator's scores (history's eval rows)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "points": len(self.steps), "stops": [asdict(s) for s in self.stops],
                "summary": self.summary,
                "last": {"step": self.steps[-1], "loss": self.loss[-1]} if self.steps else None}


def build_report(name: str, heartbeat: Sequence[Mapping[str, Any]], history: Any) -> ReportData:
    """Pure: heartbeat lines + history_rows.History -> the series to plot and the summary lines."""
    r = ReportData(name)
    for b in heartbeat:
        if b.get("event") == "step" and b.get("step") is not None and b.get("time"):
            r.steps.append(int(b["step"]))
            r.times.append(float(b["time"]))
            r.loss.append(b.get("loss"))
            r.tokens_per_s.append(b.get("tokens_per_s"))
        elif b.get("event") == "val" and b.get("val_loss") is not None and b.get("step") is not None:
            r.val_steps.append(int(b["step"]))
            r.val_loss.append(float(b["val_loss"]))
    r.eval = list(getattr(history, "eval", None) or [])
    attempts = history.attempts
    for a, nxt in zip(attempts, attempts[1:]):
        r.stops.append(Stop(a.attempt, a.end_step if a.end_step is not None else nxt.start_step, a.end_time, a.reason))
    losses = [x for x in r.loss if x is not None]
    tps = [x for x in r.tokens_per_s if x is not None]
    r.summary.append(f"run {name}: {len(attempts)} attempt(s), {len(r.stops)} stop(s)"
                     + (f" ({', '.join(s.reason for s in r.stops)})" if r.stops else ""))
    if r.steps:
        r.summary.append(f"steps {r.steps[0]} -> {r.steps[-1]} in {format_duration(r.times[-1] - r.times[0])} wall time")
    if losses:
        r.summary.append(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} (min {min(losses):.3f})")
    if r.val_loss:
        r.summary.append(f"val loss {r.val_loss[-1]:.3f} at step {r.val_steps[-1]}")
    if tps:
        r.summary.append(f"tokens/s median {sorted(tps)[len(tps) // 2]:.0f}")
    if r.eval:
        newest = max(row["step"] for row in r.eval)
        said = [f"{row['task']}/{row['metric']} {row['value']:.4g}" for row in r.eval
                if row["step"] == newest and isinstance(row.get("value"), (int, float))]
        r.summary.append(f"eval step {newest}: " + ", ".join(said[:3]) + (f" (+{len(said) - 3})" if len(said) > 3 else ""))
    r.summary.append(f"goodput {'-' if history.goodput is None else f'{100 * history.goodput:.0f}%'}, "
                     f"steps lost to stops {history.steps_lost_total}, "
                     f"queue wait {format_duration(history.queue_wait_total_s)}")
    return r


def draw_png(r: ReportData, out: Path) -> Path:
    """2 x 2 panels: loss and tokens/s against step (top) and against wall time (bottom); with an
    evaluator's scores (eval.alongside) the last panel is each task's metric against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = r.times[0] if r.times else 0.0
    minutes = [(t - t0) / 60 for t in r.times]
    fig, axes = plt.subplots(2, 2, figsize=FIGSIZE_IN, dpi=DPI)
    fig.suptitle(f"lmlaunch report: {r.name}", fontsize=13)
    panels = (
        (axes[0][0], r.steps, r.loss, "loss", "step"),
        (axes[0][1], r.steps, r.tokens_per_s, "tokens/s", "step"),
        (axes[1][0], minutes, r.loss, "loss", "wall time (min)"),
        (axes[1][1], minutes, r.tokens_per_s, "tokens/s", "wall time (min)"),
    )
    for ax, xs, ys, ylabel, xlabel in panels:
        pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color="tab:blue" if ylabel == "loss" else "tab:green",
                    lw=1.4, marker=".", ms=3, label="train")
        if ylabel == "loss" and r.val_loss:
            vx = r.val_steps if xlabel == "step" else [
                (r.times[min(range(len(r.steps)), key=lambda i: abs(r.steps[i] - s))] - t0) / 60 for s in r.val_steps]
            ax.plot(vx, r.val_loss, "o", color="tab:orange", ms=5, label="val")
            ax.legend(loc="upper right", fontsize=8)
        for i, s in enumerate(r.stops):
            x = s.step if xlabel == "step" else (None if s.time is None else (s.time - t0) / 60)
            if x is None:
                continue
            ax.axvline(x, color="tab:red", ls="--", lw=1.2)
            if ylabel == "loss" and xlabel == "step":
                ax.annotate(f"{s.reason} (att {s.attempt})", (x, 1), xycoords=("data", "axes fraction"),
                            xytext=(3, -12 - 11 * (i % 3)), textcoords="offset points", color="tab:red", fontsize=8)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    if r.eval:
        _eval_panel(axes[1][1], r.eval)
    fig.text(0.01, 0.005, "  ·  ".join(r.summary), fontsize=8.5, va="bottom", family="monospace", wrap=True)
    fig.tight_layout(rect=(0, 0.05, 1, 0.96))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return out


def _eval_panel(ax: Any, rows: Sequence[Mapping[str, Any]]) -> None:
    """Each lm-eval task's metric over the scored checkpoints' steps, on a log scale (accuracies and
    perplexities on one axis)."""
    ax.clear()
    series: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        if isinstance(row.get("value"), (int, float)) and row["value"] > 0:
            series.setdefault(f"{row['task']}/{row['metric']}", []).append((int(row["step"]), float(row["value"])))
    for label, pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, lw=1.2, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("checkpoint step")
    ax.set_ylabel("eval (lm-eval)")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=6)


def sweep_curves(points: Sequence[tuple[str, Sequence[Mapping[str, Any]]]]) -> dict[str, Any]:
    """Pure: each point's loss curve (step -> train loss, one value per step: the newest attempt's)
    and the best point (lowest final loss)."""
    curves: dict[str, tuple[list[int], list[float]]] = {}
    for name, beats in points:
        by_step: dict[int, float] = {}
        for b in beats:
            if b.get("event") == "step" and isinstance(b.get("loss"), (int, float)) and b.get("step") is not None:
                by_step[int(b["step"])] = float(b["loss"])
        steps = sorted(by_step)
        curves[name] = (steps, [by_step[s] for s in steps])
    finals = {n: ys[-1] for n, (_, ys) in curves.items() if ys}
    best = min(finals, key=lambda n: finals[n]) if finals else None
    return {"curves": curves, "best": best, "final_loss": finals}


def draw_sweep_png(name: str, data: Mapping[str, Any], out: Path) -> Path:
    """Every point's loss against step on one axis; the best point drawn thick and labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(FIGSIZE_IN[0], FIGSIZE_IN[1] * 0.6), dpi=DPI)
    for n, (xs, ys) in data["curves"].items():
        best = n == data["best"]
        ax.plot(xs, ys, lw=2.6 if best else 1.1, alpha=1.0 if best else 0.75, zorder=3 if best else 2,
                label=f"{n} (best, {ys[-1]:.3f})" if best and ys else n)
    ax.set_title(f"lmlaunch sweep report: {name} ({len(data['curves'])} points)")
    ax.set_xlabel("step")
    ax.set_ylabel("train loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="upper right")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return out
