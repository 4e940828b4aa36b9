"""One module per `lmlaunch` subcommand, each with `add_arguments(parser)` and `run(args, ctx)`.

The table below is the one list of subcommands: the CLI builds its parser from it and shell
completion lists it. Modules are imported lazily by the CLI (only the chosen one).
"""

from __future__ import annotations

import argparse

# subcommand -> (module under launcher.commands, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "validate": ("validate", "check a job spec (and its plan) without submitting"),
    "doctor": ("doctor", "preflight: will this job run on this cluster? (partition, preemption, space, data)"),
    "submit": ("submit", "submit a job spec to SLURM (or print the plan with --dry-run)"),
    "pipeline": ("pipeline", "submit a pipeline's stages at once, each after the stages it names"),
    "sweep": ("sweep", "submit a sweep of a job spec as one throttled SLURM array; `sweep results NAME`"),
    "run": ("run", "run a job spec locally on CPU (the same entry a SLURM task runs)"),
    "profiles": ("profiles", "list cluster profiles"),
    "profile": ("profile", "`profile init NAME`: write a cluster profile read off the live cluster; "
                           "`profile RUN`: torch.profiler over a running job's next steps, per rank"),
    "examples": ("examples", "write the example job specs into a directory (the demo's, GPU ones, pipelines, sweeps)"),
    "schema": ("schema", "write the JSON Schema of the job spec (for editors)"),
    "data": ("data", "prepare tokenized training data"),
    "cluster": ("cluster", "start, stop or inspect the local single-machine SLURM cluster"),
    "status": ("status", "show runs: state, step, loss, throughput"),
    "logs": ("logs", "show or follow a run's logs"),
    "dashboard": ("dashboard", "a live, read-only web page of the runs (127.0.0.1, with a token in its URL)"),
    "stacks": ("stacks", "the live Python stacks (--native: and C frames) of every task of a running job"),
    "cancel": ("cancel", "cancel a run (never requeued)"),
    "move": ("move", "move a queued run over several clusters where it starts sooner; --watch: as its spec says"),
    "history": ("history", "a run's attempts: why each ended, goodput"),
    "report": ("report", "plot a run's loss and throughput to a PNG"),
    "diff": ("diff", "what differs between two runs: spec, plan, packages, environment"),
    "export": ("export", "a checkpoint of any strategy as a transformers model directory"),
    "eval": ("eval", "score a run's checkpoints with lm-evaluation-harness, as a SLURM job"),
    "preempt": ("preempt", "rehearse preemption of a running job"),
    "metrics": ("metrics", "every run's metrics for Prometheus: `metrics serve`, or `metrics write DIR` (textfile)"),
    "notify-test": ("notify_test", "send a test message to each of a spec's notify.webhooks"),
    "completion": ("completion", "print a shell completion script (bash, zsh, fish), generated from the parsers"),
    "_checkpoint": ("checkpoint_copy", argparse.SUPPRESS),  # a copied checkpoint checked (a run over SSH clusters; hidden)
}


def add_spec_arguments(p: argparse.ArgumentParser, example: str = "resources.nodes=4") -> None:
    """SPEC [overrides...] [--cluster NAME]: how every command that plans a job spec takes it."""
    p.add_argument("spec", help="job spec YAML")
    p.add_argument("overrides", nargs="*", help=f"dotted overrides, e.g. {example}")
    p.add_argument("--cluster", help="cluster profile (overrides the spec's 'cluster' and 'clusters'); submit and "
                                     "validate take several, a,b: the run goes where it starts soonest")
    add_force_argument(p)


def add_force_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--force", action="store_true",
                   help="plan (and submit) a GPU job whose planned memory exceeds the profile's gpu_memory, "
                        "a job whose resources.mem cannot hold its staged checkpoints, "
                        "and (submit) a container job whose image or interpreter could not be started here")


def with_examples(p: argparse.ArgumentParser, *lines: str) -> None:
    """``--help`` ends with these example command lines (kept as written)."""
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = "examples:\n" + "\n".join(f"  {line}" for line in lines)


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The parsers of ``parser``'s subcommands by name (argparse keeps no public list of them)."""
    return next((dict(a.choices) for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})
