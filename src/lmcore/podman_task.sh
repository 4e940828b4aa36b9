#!/bin/bash
# One task of a podman container job (lmcore.container): its container is named after the
# cluster, the job and the task (job ids of two clusters on one host can be equal), and an earlier
# attempt's container of the same name on this node (its client SIGKILLed at a time limit or a
# preemption, which leaves the container running) is removed first.
# Arguments: podman run's, up to and including the image and the command.
# (LMLAUNCH_TASK_ROLE: the evaluator alongside, a task 0 of the same job beside rank 0's)
name="lmlaunch-${SLURM_CLUSTER_NAME:-slurm}-${SLURM_JOB_ID:?}-${SLURM_PROCID:?}${LMLAUNCH_TASK_ROLE:+-$LMLAUNCH_TASK_ROLE}"
podman rm --force --ignore "$name" >/dev/null 2>&1
# SLURM kills this process (the podman client), not the container conmon keeps: the ranks inside
# end when it is gone (lmtrain.task.main.watch_owner; --pid=host shares the pids)
export LMLAUNCH_TASK_PID=$$
exec podman run --name "$name" "$@"
