"""Putting a plan on the cluster: the submission through submitit (its only user), the run's
lifecycle (new, resumed, archived, cancelled), dependencies between runs, pipelines of stages,
the batch script's restart-in-place loop and shell words, task arrays cut at MaxArraySize, the
``stacks`` step script, and ``data prepare --on-cluster``.

May import: lmcore, launcher.spec, launcher.runs, launcher.planning. Not monitoring, serving,
doctor, search, remote or commands.
"""
