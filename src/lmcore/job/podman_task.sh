#!/bin/bash
# One task of a podman container job (lmcore.job.container): its container is named after the
# cluster, the job and the task (job ids of two clusters on one host can be equal), and an earlier
# attempt's container of the same name on this node (its client SIGKILLed at a time limit or a
# preemption, which leaves the container running) is removed first.
# Arguments: podman run's, up to and including the image and the command.
# (LMLAUNCH_TASK_ROLE: the evaluator alongside, a task 0 of the same job beside rank 0's)
name="lmlaunch-${SLURM_CLUSTER_NAME:-slurm}-${SLURM_JOB_ID:?}-${SLURM_PROCID:?}${LMLAUNCH_TASK_ROLE:+-$LMLAUNCH_TASK_ROLE}"
podman rm --force --ignore "$name" >/dev/null 2>&1
# SLURM signals and kills this shell and the podman client, not the container conmon keeps. Its
# processes carry this shell's pid (LMLAUNCH_TASK_PID, set for the container only: conmon and the
# client do not have it); --pid=host shares the pids:
# - a signal SLURM sends (SIGTERM at a preemption, the warning signal) reaches them from here, as
#   SLURM's own signal reaches every process of a task outside a container. The client's
#   forwarding (--sig-proxy) alone lost a SIGTERM under load: the ranks never saw the preemption
#   and SIGKILL came at the end of GraceTime with no checkpoint written;
# - when this shell is gone (SIGKILL), they end (lmtrain.task.agent.owner_alive).
signal_container() {
    local files f pid
    files=$(grep -lxzF "LMLAUNCH_TASK_PID=$$" /proc/[0-9]*/environ 2>/dev/null)
    for f in $files; do
        pid=${f#/proc/}
        kill -s "$1" "${pid%/environ}" 2>/dev/null
    done
}
for sig in TERM INT HUP QUIT USR1 USR2 ALRM CONT; do
    trap "signal_container $sig" "$sig"
done
podman run --name "$name" --env "LMLAUNCH_TASK_PID=$$" "$@" &
client=$!
while kill -0 "$client" 2>/dev/null; do
    wait "$client"  # returns early for a trapped signal: wait again
done
wait "$client"  # the client's status, kept by the shell
