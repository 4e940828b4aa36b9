"""What the user sees of runs: status and history as row models (pure), their Rich renderings,
the run directory's files as the monitor reads them, what SLURM says of the runs' jobs (one
squeue, one sacct) and its cache, reports (PNG), ``diff`` of two runs, a sweep's rows.

May import: lmcore, launcher.spec, launcher.runs, launcher.planning. Not submission, serving,
doctor, search, remote or commands.
"""
