"""The plan's memory estimate (launcher.planning.memory) against what a run's ranks really held (the
ledger's ``memory`` lines, lmtrain.model.memory_held): parameters, gradients and optimizer states of the
worst rank, per attempt, at the attempt's own world size (an elastic resume changes it)."""

from __future__ import annotations

import json
from pathlib import Path

from launcher.planning import memory, memory_stages
from launcher.planning.memory_check import setup_of
from launcher.planning.memory_inputs import model_facts
from lmcore.job.plan import LaunchPlan
from lmcore.run.rank_logs import rank_text

STATES = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer states"}


def held_against_estimate(run_dir: str | Path) -> list[dict]:
    """One entry per measured attempt: world size, and per category (measured max over ranks, estimate)."""
    run_dir = Path(run_dir)
    plan = LaunchPlan.from_dict(json.loads((run_dir / "plan.json").read_text()))
    spec = plan.job_spec()
    facts = model_facts(spec, gpu=plan.topology.accelerator == "gpu")
    lines = [json.loads(x) for x in (run_dir / "attempts.jsonl").read_text().splitlines() if x.strip()]
    worlds = {e["attempt"]: e["world_size"] for e in lines if e.get("event") == "start"}
    out = []
    for e in lines:
        if e.get("event") != "memory" or "held" not in e:
            continue
        world = worlds[e["attempt"]]
        assert len(e["held"]) == world, e
        setup = setup_of(spec, plan)
        setup = setup.on(setup.parallelism.with_world(world))
        par = setup.parallelism
        if par.pipeline > 1:  # each rank against its own stage's plan: the worst rank's difference
            stages = [{r.name: r.bytes for r in b.rows} for b in memory_stages.per_rank(facts, setup)]
            planned = [stages[(g // par.tensor) % par.pipeline] for g in range(world)]
            worst = {k: max(range(world), key=lambda g: abs(e["held"][g][k] - planned[g][STATES[k]])) for k in STATES}
            out.append({"attempt": e["attempt"], "world_size": world,
                        **{k: (e["held"][g][k], planned[g][STATES[k]]) for k, g in worst.items()}})
            continue
        rows = {r.name: r.bytes for r in memory.model_states(facts, setup)}  # no activation trace needed
        out.append({"attempt": e["attempt"], "world_size": world,
                    **{k: (max(rank[k] for rank in e["held"]), rows[name]) for k, name in STATES.items()}})
    return out


def assert_states_as_planned(run_dir: str | Path, attempts: int = 1) -> None:
    """Each measured attempt's model states within 1 % of the plan's (and at least ``attempts`` measured)."""
    got = held_against_estimate(run_dir)
    assert len(got) >= attempts, f"{len(got)} attempt(s) measured in {run_dir}, expected {attempts}"
    for entry in got:
        for k in STATES:
            held, planned = entry[k]
            assert abs(held - planned) <= 0.01 * held, (
                f"attempt {entry['attempt']} on {entry['world_size']} rank(s): {k} held {held:,} B, planned {planned:,} B")


def assert_staging_as_planned(run_dir: str | Path, tolerance: float = 0.01) -> None:
    """Rank 0's staging buffers, as its reservation logged them (lmtrain.checkpoint.manager.reserve),
    within ``tolerance`` of the plan's ``memory.host_staging.per_rank`` (rank 0 is the heaviest
    staging rank of every strategy)."""
    import re

    run_dir = Path(run_dir)
    plan = json.loads((run_dir / "plan.json").read_text())
    planned = plan["memory"]["host_staging"]["per_rank"]
    log = rank_text(run_dir / "logs" / "attempt-1", 0)
    found = re.findall(r"staging buffers reserved: (\d+) bytes", log)
    assert found, "rank 0 never reserved its staging buffers"
    held = int(found[-1])
    assert abs(held - planned) <= tolerance * planned, (held, planned, plan["memory"]["host_staging"])
