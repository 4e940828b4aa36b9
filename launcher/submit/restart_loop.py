"""The restart-in-place loop of a job's batch script (the shell lines around srun), for
launcher.submit.script, which renders the script: srun runs again while the attempt's rank 0 asks
(lmtrain.preemption.controller writes the decision file), or when srun failed and rank 0 never
decided; a job SLURM is preempting requeues itself instead."""

from __future__ import annotations

from launcher.submit.keeper import keeper_lines
from lmcore.job.plan import LaunchPlan
from lmcore.run import rundir
from lmcore.run.run_layout import UNDECIDED_VAR


def restart_loop_head(plan: LaunchPlan) -> list[str]:
    """The last setup lines of a job that restarts in place: srun (the command section) runs in a
    loop, once more each time the attempt's rank 0 asked for it (lmtrain.preemption.controller:
    the decision file, written after the attempt's end line), or when srun failed and rank 0 never
    decided (its process was killed: SIGKILL, the OOM killer), at most max_crash_retries times."""
    if not plan.preemption.restart_in_place:
        return []
    return ["# lmlaunch: a crash or a hang is retried in this allocation: srun again while rank 0 asks "
            "($LMLAUNCH_RUN_DIR/" + rundir.RESTART_IN_PLACE + ": the job id, the nodes the ranks leave out, "
            "rank 0's decision), or when srun failed and rank 0 never decided",
            'rm -f "$LMLAUNCH_RUN_DIR/' + rundir.RESTART_IN_PLACE + '"  # an earlier job\'s, never this one\'s',
            "lmlaunch_restarts=0",
            "lmlaunch_undecided=0",
            "lmlaunch_exclude=",
            "lmlaunch_overlap=  # set from the first restart on (launcher.submit.script.restart_srun_prefix)",
            "# a preemption that lands between two sruns signals no task of the next: do not start one then",
            "lmlaunch_preempting() { scontrol show job \"$SLURM_JOB_ID\" 2>/dev/null | grep -q 'PreemptTime=[0-9]'; }",
            "while :; do", *keeper_lines(plan)]


def restart_loop_tail(plan: LaunchPlan) -> str:
    """What follows srun in a job that restarts in place: the loop's test and end, the job's exit
    status srun's last. Rank 0's file names this job (a file of another job is never this one's);
    its third line is the decision (``restart``, or what rank 0 did instead: ``requeue``,
    ``cancel``, ``none``; no third line: a run directory's older code, which wrote only restarts)."""
    if not plan.preemption.restart_in_place:
        return ""
    said = '"$LMLAUNCH_RUN_DIR/' + rundir.RESTART_IN_PLACE + '"'
    most = plan.preemption.max_crash_retries
    return "\n".join([
        "",
        "lmlaunch_rc=$?",
        f"lmlaunch_said=$(cat {said} 2>/dev/null); rm -f {said}",
        'lmlaunch_decision=$(printf "%s\\n" "$lmlaunch_said" | sed -n 3p)',
        f"export {UNDECIDED_VAR}=",
        'if [ -n "$SLURM_JOB_ID" ] && [ "$(printf "%s\\n" "$lmlaunch_said" | sed -n 1p)" = "$SLURM_JOB_ID" ]; then',
        '  if [ -z "$lmlaunch_decision" ] || [ "$lmlaunch_decision" = restart ]; then  # this job\'s rank 0 asked',
        '    lmlaunch_exclude=$(printf "%s\\n" "$lmlaunch_said" | sed -n 2p); lmlaunch_restarts=$((lmlaunch_restarts + 1))',
        '    echo "lmlaunch: restarting the ranks in place ($lmlaunch_restarts; srun exited $lmlaunch_rc${lmlaunch_exclude:+; '
        'not on $lmlaunch_exclude})" >&2',
        *_unless_preempting("    "),
        "    lmlaunch_overlap=1",
        "    continue",
        "  fi",
        f'elif [ -n "$SLURM_JOB_ID" ] && [ "$lmlaunch_rc" -ne 0 ] && [ "$lmlaunch_undecided" -lt {most} ]; then',
        "  # rank 0 never decided (killed before its end line): the next attempt's rank 0 records why",
        "  lmlaunch_undecided=$((lmlaunch_undecided + 1)); lmlaunch_restarts=$((lmlaunch_restarts + 1))",
        f'  export {UNDECIDED_VAR}="$lmlaunch_rc"',
        '  echo "lmlaunch: srun exited $lmlaunch_rc and rank 0 never decided (killed?): restarting the ranks in place '
        f'($lmlaunch_restarts; $lmlaunch_undecided of max_crash_retries({most}))" >&2',
        *_unless_preempting("  "),
        "  lmlaunch_overlap=1",
        "  continue",
        "fi",
        "break",
        "done",
        '(exit "$lmlaunch_rc")',
    ])


def _unless_preempting(indent: str) -> list[str]:
    """Before a restart: a job SLURM is preempting (PreemptTime set, its GraceTime running) requeues
    itself instead, as rank 0 would (SLURM 22.05 ends a preempted job whose tasks exit within
    GraceTime as COMPLETED, never requeued); the next attempt resumes from the newest checkpoint."""
    return [f"{indent}if lmlaunch_preempting; then",
            f'{indent}  echo "lmlaunch: the job is being preempted (PreemptTime set): requeueing it, not restarting '
            f'the ranks" >&2',
            f'{indent}  scontrol requeue "$SLURM_JOB_ID" || echo "lmlaunch: scontrol requeue failed" >&2',
            f"{indent}  break",
            f"{indent}fi"]
