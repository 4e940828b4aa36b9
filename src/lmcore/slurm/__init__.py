"""The one SLURM client: every sbatch/srun/sacct/squeue/scontrol/scancel/sinfo/sacctmgr command
line outside the local cluster's own administration (launcher.localcluster) is built here, and
every answer parsed here into typed records. Everything else asks it.

- ``client``: running the commands (timeouts, one field separator, typed errors) and the queries
  and controls both sides use (job states, requeue, cancel, holds, partitions, accounting).
- ``relay``: SLURM's commands for ranks that run in a container without them (the batch step
  runs them on the host); ``slurm_relay.sh`` is its host side.
- the ways to reach SLURM: its commands here (``commands_target``), the same over SSH in a login
  shell (``ssh``: the ssh command line and paths on that machine), slurmrestd (``rest``,
  ``rest_calls``, ``rest_job``, ``rest_records``); ``versions``: what differs by SLURM release.

May import: lmcore's primitives (errors, atomic, jsonlines), lmcore.job's rules. Never launcher or lmtrain.
"""
