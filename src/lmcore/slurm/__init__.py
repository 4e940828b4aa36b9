"""The one SLURM client: every sbatch/srun/sacct/squeue/scontrol/scancel/sinfo/sacctmgr command
line outside the local cluster's own administration (launcher.localcluster) is built here, and
every answer parsed here into typed records. Everything else asks it.

- ``client``: the one face: the queries and controls both sides use (job states, requeue, cancel,
  holds, partitions, accounting), each asked of the way in force (``way_in_force``, the one place
  that tells the ways apart).
- ``way``: what lmlaunch asks SLURM (the protocol ``Way``), answered by each way to reach it:
  SLURM's commands here or in a login shell over SSH (``commands``: running them with timeouts, one
  field separator, typed errors; ``commands_target``: a cluster's SLURM_CONF, clients and login
  node; ``ssh``: the ssh command line and paths on that machine) and slurmrestd (``rest_way``, over
  ``rest``, ``rest_calls``, ``rest_job``, ``rest_records``). Each submits a rendered job
  (``batch_job.BatchJob``: the script's text and its header's options, one model).
- ``relay``: SLURM's commands for ranks that run in a container without them (the batch step
  runs them on the host); ``slurm_relay.sh`` is its host side.
- ``versions``: what differs by SLURM release; ``admin``: the login side's SLURM writes besides
  submission.

May import: lmcore's primitives (errors, atomic, jsonlines), lmcore.job's rules. Never launcher or lmtrain.
"""
