"""Rich renderings of launcher.monitor.status_rows's row models: the status table, the history table.

Pure: each function takes rows and returns a renderable; the commands print them on a Console
(tests print them on a fixed-width Console writing to a StringIO). rich is imported here only,
so `status --json` never loads it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # rich is imported where it renders: plain `status` never loads it
    from rich.console import Console, Group
    from rich.text import Text

from launcher.monitor.history_rows import History
from launcher.monitor.slurm_view import UNREACHABLE, SlurmView, format_duration
from launcher.monitor.status_rows import StatusRow

GROUP_STYLE = {
    "queued": "yellow",
    "running": "bold green",
    "completed": "cyan",
    "preempted": "magenta",
    "cancelled": "dim",
    "failed": "bold red",
    "timeout": "red",
    "unknown": "bold yellow",
}
BAR_WIDTH = 12
PIPE_WIDTH = 200  # output to a file or pipe: wide enough that no column is squeezed away


def make_console(ctx) -> Console:
    """A Console on the command's stdout; a terminal's own width, COLUMNS, or PIPE_WIDTH."""
    from rich.console import Console

    isatty = getattr(ctx.stdout, "isatty", lambda: False)()
    cols = (ctx.environ or {}).get("COLUMNS", "")
    # a terminal's own width unless COLUMNS says (a warm process renders for a client's terminal: launcher.remote.warm)
    width = int(cols) if cols.isdigit() else (None if isatty else PIPE_WIDTH)
    return Console(file=ctx.stdout, width=width, highlight=False, soft_wrap=False)


def progress_bar(step: int | None, max_steps: int | None, width: int = BAR_WIDTH) -> Text:
    """`━━━━━━╺━━━━━  75/150` (no rich.progress import: status must start fast)."""
    from rich.text import Text

    if step is None:
        return Text("-", style="dim")
    if not max_steps:
        return Text(f"{step}")
    frac = max(0.0, min(1.0, step / max_steps))
    filled = int(round(frac * width))
    t = Text()
    t.append("━" * filled, style="green" if frac < 1 else "cyan")
    if filled < width:
        t.append("╺" if filled else "━", style="grey37")
        t.append("━" * (width - filled - 1), style="grey37")
    t.append(f" {step}/{max_steps}")
    return t


def _state_text(r: StatusRow) -> Text:
    from rich.text import Text

    t = Text(r.state, style=GROUP_STYLE.get(r.group, ""))
    if r.reason:
        t.append(f" ({r.reason})", style="yellow")
    return t


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _tokens(v: float | None) -> str:
    if v is None:
        return "-"
    if v >= 1e6:
        return f"{v / 1e6:.2f}M"
    if v >= 1e4:
        return f"{v / 1e3:.1f}k"
    return f"{v:.0f}"


ANSI = {"yellow": "33", "bold green": "1;32", "cyan": "36", "magenta": "35", "dim": "2", "bold red": "1;31",
        "red": "31", "bold yellow": "1;33", "green": "32", "grey37": "90", "bold": "1"}
COLUMNS = ("RUN", "JOB", "STATE", "NODES", "TIME/LIMIT", "ATT", "PROGRESS", "LOSS", "TOK/S", "MFU", "CKPT", "ETA")
RIGHT = {"NODES", "ATT", "LOSS", "TOK/S", "MFU", "ETA"}


def _paint(text: str, style: str, color: bool) -> str:
    return f"\x1b[{ANSI[style]}m{text}\x1b[0m" if color and style in ANSI else text


def _bar_plain(step: int | None, max_steps: int | None, color: bool) -> tuple[str, int]:
    """The progress bar as (text with optional ANSI colors, printed width)."""
    if step is None:
        return "-", 1
    if not max_steps:
        return str(step), len(str(step))
    frac = max(0.0, min(1.0, step / max_steps))
    filled = int(round(frac * BAR_WIDTH))
    done = _paint("━" * filled, "green" if frac < 1 else "cyan", color)
    rest = ""
    if filled < BAR_WIDTH:
        rest = _paint(("╺" if filled else "━") + "━" * (BAR_WIDTH - filled - 1), "grey37", color)
    tail = f" {step}/{max_steps}"
    return done + rest + tail, BAR_WIDTH + len(tail)


def status_lines(rows: Sequence[StatusRow], *, color: bool = False) -> list[str]:
    """The status table as lines, laid out by hand: a rich Table measures every cell and costs
    ~0.5 s for 200 runs, longer than the whole status budget (bench/status_latency.py)."""
    cells: list[list[tuple[str, int]]] = []  # (text, printed width) per column
    several = len({r.cluster for r in rows}) > 1  # runs on several clusters: each job says where
    for r in rows:
        state = _paint(r.state, GROUP_STYLE.get(r.group, ""), color)
        width = len(r.state)
        if r.reason:
            state += _paint(f" ({r.reason})", "yellow", color)
            width += len(r.reason) + 3
        ck = "-" if r.checkpoint_step is None else f"{r.checkpoint_step} ({format_duration(r.checkpoint_age_s)} ago)"
        att = (f"{r.attempt}" + ("↻" if r.requeued else "")) if r.attempt else "-"
        plain = [
            r.name, (r.job_id or "-") + (f"@{r.cluster}" if several and r.job_id else ""), None,
            "-" if r.nodes is None else str(r.nodes),
            f"{r.elapsed or '-'}/{r.time_limit or '-'}", att, None, _fmt(r.loss, ".3f"), _tokens(r.tokens_per_s),
            "-" if r.mfu is None else f"{100 * r.mfu:.1f}%", ck, format_duration(r.eta_s) if r.eta_s is not None else "-",
        ]
        row = [(t, len(t)) if t is not None else ("", 0) for t in plain]
        row[2] = (state, width)
        row[6] = _bar_plain(r.step, r.max_steps, color)
        cells.append(row)
    widths = [max([len(h)] + [c[i][1] for c in cells]) for i, h in enumerate(COLUMNS)]
    out = ["  ".join(_paint(h.ljust(w) if h not in RIGHT else h.rjust(w), "bold", color)
                     for h, w in zip(COLUMNS, widths)).rstrip()]
    for row in cells:
        parts = []
        for h, w, (text, n) in zip(COLUMNS, widths, row):
            pad = " " * (w - n)
            parts.append(pad + text if h in RIGHT else text + pad)
        out.append("  ".join(parts).rstrip())
    return out


def status_text(rows: Sequence[StatusRow], view: SlurmView, *, hidden: int = 0, now: float | None = None,
                color: bool = False) -> str:
    """The whole status screen as text (what `status` prints; `--watch` shows it through rich.live)."""
    parts: list[str] = []
    if not view.reachable:
        parts.append(_paint(f"SLURM unreachable: {view.message}\nshowing what the registry and the run "
                            f"directories say; state is '{UNREACHABLE}'", "bold yellow", color))
    elif view.message:
        parts.append(_paint(view.message, "yellow", color))
    if rows:
        parts.extend(status_lines(rows, color=color))
    else:
        parts.append("no runs registered" + (f" in the last day ({hidden} older: --all)" if hidden else "")
                     + "; submit one with `lmlaunch submit JOB.yaml`")
    for r in rows:
        if r.note:
            parts.append(_paint(f"  · {r.name}: {r.note}", "dim", color))
    if rows and hidden:
        parts.append(_paint(f"{hidden} older finished run(s) hidden; --all shows them", "dim", color))
    if now is not None:
        parts.append(_paint(time.strftime("updated %H:%M:%S", time.localtime(now)), "dim", color))
    return "\n".join(parts)


def status_view(rows: Sequence[StatusRow], view: SlurmView, *, hidden: int = 0, now: float | None = None) -> Text:
    """status_text as a rich renderable (for rich.live in --watch)."""
    from rich.text import Text

    return Text.from_ansi(status_text(rows, view, hidden=hidden, now=now, color=True))


def _clock(t: float | None) -> str:
    return "-" if t is None else time.strftime("%m-%d %H:%M:%S", time.localtime(t))


STARTUP_COLUMNS = (("launch", "LAUNCH"), ("entry", "ENTRY"), ("imports", "IMPORTS"), ("gate", "GATE"),
                   ("rendezvous", "RDZV"), ("data", "DATA"), ("model", "MODEL"), ("restore", "RESTORE"),
                   ("first_step", "1ST STEP"))


def startup_view(h: History) -> Group:
    """``history --timing``: seconds from each attempt's allocation to its first step, by phase."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, header_style="bold", pad_edge=False)
    table.add_column("ATT", justify="right")
    for _, title in STARTUP_COLUMNS:
        table.add_column(title, justify="right")
    table.add_column("TOTAL", justify="right", style="bold")
    table.add_column("CHECKPOINT", justify="right")
    for a in h.attempts:
        phases = a.startup or {}
        cells = ["-" if key not in phases else f"{phases[key]:.2f}" for key, _ in STARTUP_COLUMNS]
        total = "-" if a.startup_total_s is None else f"{a.startup_total_s:.2f}"
        if a.startup and a.startup_total_s is None:
            total = "no step"
        size = "-" if a.checkpoint_bytes is None else f"{a.checkpoint_bytes / 1e6:.1f} MB"
        table.add_row(str(a.attempt), *cells, total, size)
    legend = Text(
        "seconds per phase: LAUNCH allocation start (sacct, whole seconds) -> process start; ENTRY interpreter "
        "and task unpickling; IMPORTS torch, lightning, transformers, the plan; GATE ledger, start gate, checkpoint choice; "
        "RDZV rendezvous; DATA token files and sampler; MODEL module and Trainer built; RESTORE fit setup, "
        "process group, checkpoint read and loaded; 1ST STEP the first optimizer step", style="dim")
    parts: list = [Text(f"{h.name}: startup of {len(h.attempts)} attempt(s)", style="bold"), table, legend]
    if not any(a.startup for a in h.attempts):
        parts.append(Text("no attempt has a startup record (attempts that began before lmlaunch recorded one, "
                          "or that have not reached their first step yet)", style="yellow"))
    return Group(*parts)


def _gpu_hours(hours: float | None) -> str:
    if hours is None:
        return "-"
    return f"{hours:.2f}" if hours >= 0.1 else f"{hours:.4f}"


def history_view(h: History) -> Group:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, header_style="bold", pad_edge=False)
    # why each attempt ended is the table's point: that column never shrinks (headers may)
    ended_width = max([len(a.reason) + (2 if a.requeued else 0) for a in h.attempts] + [5])
    for col, kw in (
        ("ATT", {"justify": "right"}), ("JOB", {"no_wrap": True}), ("NODES", {}),
        ("STARTED", {"no_wrap": True}), ("QUEUED", {"justify": "right"}), ("STEPS", {"no_wrap": True}),
        ("ENDED", {"no_wrap": True, "min_width": ended_width}),
        ("LOST", {"justify": "right"}), ("TRAIN/ALLOC", {"no_wrap": True}), ("GOODPUT", {"justify": "right"}),
    ):
        table.add_column(col, **kw)
    gpus = h.gpu_hours is not None
    if gpus:  # a GPU job with accounting: what each attempt held, in GPU-hours (sacct's AllocTRES)
        table.add_column("GPU-H", justify="right", no_wrap=True)
    for a in h.attempts:
        style = {"completed": "cyan", "preempted": "magenta", "timeout": "red", "crashed": "bold red", "disk_full": "bold red",
                 "cancelled": "dim", "running": "bold green", "unknown": "bold yellow"}.get(a.reason, "")
        steps = f"{'-' if a.start_step is None else a.start_step} → {'-' if a.end_step is None else a.end_step}"
        ended = Text(a.reason + (" ↻" if a.requeued else ""), style=style)
        good = "-" if not a.alloc_s or a.train_s is None else f"{100 * min(1.0, a.train_s / a.alloc_s):.0f}%"
        table.add_row(
            str(a.attempt), (a.job_id or "-") + (f" on {a.cluster}" if a.cluster else ""), ",".join(a.nodes) or "-",
            _clock(a.start_time), format_duration(a.queue_wait_s), steps, ended,
            "-" if a.steps_lost is None else str(a.steps_lost),
            f"{format_duration(a.train_s)}/{format_duration(a.alloc_s)}", good,
            *([_gpu_hours(a.gpu_hours) + (f" ({a.gpus} GPUs)" if a.gpus else "")] if gpus else []),
        )
    summary = Text()
    summary.append(f"{h.name}: {len(h.attempts)} attempt(s)", style="bold")
    summary.append(f" · goodput {'-' if h.goodput is None else f'{100 * h.goodput:.0f}%'}")
    summary.append(f" · steps lost to stops {h.steps_lost_total}")
    summary.append(f" · queue wait {format_duration(h.queue_wait_total_s)}")
    if gpus:
        summary.append(f" · GPU-hours {_gpu_hours(h.gpu_hours)}, {_gpu_hours(h.train_gpu_hours)} of them training")
    if h.cancel_requested:
        summary.append(f" · cancel requested {_clock(h.cancel_requested)}", style="yellow")
    parts: list = [summary, table]
    for a in h.attempts:
        if a.detail:
            parts.append(Text(f"  attempt {a.attempt}: {a.detail}", style="dim"))
    if h.eval:
        scores = Table(box=None, header_style="bold", pad_edge=False, title_justify="left")
        for col in ("STEP", "TASK", "METRIC", "VALUE"):
            scores.add_column(col, justify="right" if col in ("STEP", "VALUE") else "left", no_wrap=True)
        for row in h.eval:
            err = row.get("stderr")
            value = row.get("value")
            scores.add_row(str(row.get("step")), str(row.get("task")), str(row.get("metric")),
                           (f"{value:.4g}" if isinstance(value, (int, float)) else str(value))
                           + (f" ± {err:.2g}" if isinstance(err, (int, float)) else ""))
        parts += [Text(f"scores of {len({r.get('step') for r in h.eval})} checkpoint(s) (eval.alongside, lm-eval "
                       f"{h.eval[-1].get('lm_eval')})", style="bold"), scores]
    for n in h.notes:
        parts.append(Text(n, style="yellow"))
    return Group(*parts)
