"""The one SLURM client: every sbatch/srun/sacct/squeue/scontrol/scancel/sinfo/sacctmgr command
line outside the local cluster's own administration (launcher.localcluster) is built here, and
every answer parsed here into typed records. Everything else asks it.

- ``client``: running the commands (timeouts, one field separator, typed errors) and the queries
  and controls both sides use (job states, requeue, cancel, holds, partitions, accounting).
- ``relay``: SLURM's commands for ranks that run in a container without them (the batch step
  runs them on the host); ``slurm_relay.sh`` is its host side.

May import: lmcore's primitives (errors, text_rules). Never launcher or lmtrain.
"""
