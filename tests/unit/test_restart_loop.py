"""The batch script's restart loop (restart in place, launcher.submit.in_place): srun runs again only when
this job's rank 0 asked (the request file names this job), the request is consumed, a stale one
of an earlier job is dropped first, and the job's exit status is srun's last. Run with bash and
a stand-in srun; the rank-0 side is lmtrain.preemption.controller, the cluster test
tests/integration/test_restart_in_place.py."""

from __future__ import annotations

import io
import json
import subprocess

import pytest
import waiting

from launcher.cli import main
from launcher.context import Context


def _script(repo, runs_root, *overrides: str) -> str:
    out, err = io.StringIO(), io.StringIO()
    code = main(["submit", str(repo / "jobs" / "tiny-cpu.yaml"), *overrides, "--dry-run", "--json"],
                Context(stdout=out, stderr=err, environ={"LMLAUNCH_RUNS_ROOT": str(runs_root)}))
    assert code == 0, err.getvalue()
    return json.loads(out.getvalue())["script"]


def _run(script: str, tmp_path, codes: list[int], *, ask_on: set[int], stale: str | None = None,
         job_id: str | None = "77", said: dict[int, str] | None = None, preempt_time: str = "None"):
    """The script from its setup on, with srun a function: call i exits codes[i] and, for i in
    ``ask_on``, first writes the request as this job's rank 0 does (``said``: call i writes that
    text instead, another decision); each call records the undecided variable it was started with."""
    said = {**{i: "77\\n\\nrestart" for i in ask_on}, **(said or {})}
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    if stale is not None:
        (run_dir / "RESTART_IN_PLACE").write_text(stale + "\n")
    calls = tmp_path / "calls"
    fake = "\n".join([
        # SLURM's view of the job: PreemptTime as the test says; a requeue recorded
        f'scontrol() {{ if [ "$1" = show ]; then echo "   PreemptTime={preempt_time}"; else echo "$*" >> {tmp_path / "scontrol"}; fi; }}',
        "srun() {",
        f'  n=$(( $(cat {calls} 2>/dev/null || echo 0) + 1 )); echo $n > {calls}',
        f'  echo "${{LMLAUNCH_UNDECIDED_END:-}}" >> {tmp_path / "undecided"}',
        *(f'  if [ $n -eq {i + 1} ]; then printf "{text}\\n" > "$LMLAUNCH_RUN_DIR/RESTART_IN_PLACE"; fi'
          for i, text in sorted(said.items())),
        f"  codes=({' '.join(map(str, codes))}); return ${{codes[$((n - 1))]}}",
        "}",
    ])
    body = script[script.index("# setup"):]
    body = "\n".join(x for x in body.splitlines() if not x.startswith("export LMLAUNCH_RUN_DIR="))
    proc = subprocess.run(["bash", "-c", fake + "\n" + body], capture_output=True, text=True,
                          env={**({"SLURM_JOB_ID": job_id} if job_id else {}), "LMLAUNCH_RUN_DIR": str(run_dir),
                               "PATH": "/usr/bin:/bin"}, timeout=waiting.HANG_S)  # a loop that never ends fails
    return proc.returncode, int(calls.read_text()), (run_dir / "RESTART_IN_PLACE").exists(), proc.stderr


@pytest.mark.parametrize("codes, ask_on, stale, want", [
    ([0], set(), None, (0, 1)),  # trained to the end: once
    ([1, 0], {0}, None, (0, 2)),  # crashed, rank 0 asked: again, then completed
    ([1, 1, 3], {0, 1}, None, (3, 3)),  # asked twice: the job's status is the last srun's
    ([0], set(), "12", (0, 1)),  # an earlier job's request is never this job's
])
def test_srun_runs_again_only_when_this_jobs_rank_zero_asked(repo, runs_root, tmp_path, codes, ask_on, stale, want):
    last = len(codes) - 1  # rank 0 of the last attempt decided it ends there
    code, calls, left, err = _run(_script(repo, runs_root), tmp_path, codes, ask_on=ask_on, stale=stale,
                                  said={last: "77\\n\\nnone"} if last not in ask_on else None)
    assert (code, calls) == want, err
    assert not left  # consumed (or a stale one dropped)
    assert err.count("lmlaunch: restarting the ranks in place") == len(ask_on)


@pytest.mark.parametrize("text", ["77\\n\\nrequeue", "77\\nn2\\ncancel", "77\\n\\nnone"])
def test_a_crash_rank_zero_decided_otherwise_ends_the_loop(repo, runs_root, tmp_path, text):
    """Rank 0 requeued the job, cancelled it or stopped it: the job ends with srun's status."""
    code, calls, left, err = _run(_script(repo, runs_root), tmp_path, [1], ask_on=set(), said={0: text})
    assert (code, calls, left) == (1, 1, False), err


def test_the_older_request_without_a_decision_still_restarts(repo, runs_root, tmp_path):
    """A run resumed without --new-code runs its snapshot's rank 0, which wrote only the job id."""
    code, calls, _, err = _run(_script(repo, runs_root), tmp_path, [1, 0], ask_on=set(), said={0: "77"})
    assert (code, calls) == (0, 2), err


def test_when_rank_zero_never_decided_the_ranks_restart_at_most_max_crash_retries_times(repo, runs_root, tmp_path):
    """srun failed and no decision file: rank 0 was killed before its end line (SIGKILL, the OOM
    killer). The ranks start again, told srun's status (the next start gate records the missing
    end), at most preemption.max_crash_retries times; a decided restart clears the variable."""
    script = _script(repo, runs_root, "preemption.max_crash_retries=2")
    code, calls, _, err = _run(script, tmp_path, [137, 137, 1, 0], ask_on=set())
    assert (code, calls) == (1, 3), err  # the third failure ends the job with its status
    assert (tmp_path / "undecided").read_text().split("\n")[:3] == ["", "137", "137"]
    assert err.count("rank 0 never decided (killed?): restarting the ranks in place") == 2
    (tmp_path / "undecided").unlink()
    (tmp_path / "calls").unlink()
    (tmp_path / "run").rmdir()
    code, calls, _, err = _run(script, tmp_path, [137, 1, 0], ask_on={1})
    assert (code, calls) == (0, 3), err
    assert (tmp_path / "undecided").read_text().split("\n")[:3] == ["", "137", ""]


@pytest.mark.parametrize("ask", [True, False], ids=["asked", "undecided"])
def test_a_job_being_preempted_requeues_itself_instead_of_restarting(repo, runs_root, tmp_path, ask):
    """A preemption that lands between two sruns signals no task of the next one: the loop sees the
    job's PreemptTime and requeues the job (scontrol requeue) rather than start the ranks again."""
    code, calls, _, err = _run(_script(repo, runs_root), tmp_path, [1, 0], ask_on={0} if ask else set(),
                               preempt_time="2026-11-28T08:00:00")
    assert calls == 1 and code == 1, err
    assert (tmp_path / "scontrol").read_text().split() == ["requeue", "77"]
    assert "the job is being preempted (PreemptTime set): requeueing it" in err


def test_outside_a_job_no_request_is_ever_this_jobs(repo, runs_root, tmp_path):
    """Run by hand (no SLURM_JOB_ID) the missing request and the missing id are both empty: never a restart."""
    code, calls, _, err = _run(_script(repo, runs_root), tmp_path, [1], ask_on=set(), job_id=None)
    assert (code, calls) == (1, 1), err


def test_without_restart_in_place_the_script_runs_srun_once(repo, runs_root):
    script = _script(repo, runs_root, "preemption.restart_in_place=false")
    assert "while :; do" not in script and "RESTART_IN_PLACE" not in script
    assert script.rstrip().splitlines()[-1].startswith("srun ")
