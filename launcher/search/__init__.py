"""Many runs from one spec: sweeps (points, one throttled SLURM array), Optuna searches (their
plan and directory, the pure policy of what the driver does next, the driver), the array's
setup on the allocation. Optuna itself is owned by lmcore.search.study.

May import: lmcore, launcher.spec, launcher.runs, launcher.planning, launcher.submit,
launcher.monitor. Never launcher.localcluster (a local cluster's study storage is handed in by
the command).
"""
