"""Putting a plan on the cluster: every batch script rendered in one module (``script``: a run's,
with its restart-in-place loop, a sweep array's, data prepare's, `lmlaunch eval`'s), shell words (``shell``), the
submission through submitit (``submission``), the run's lifecycle (new, resumed, archived,
cancelled) and a local run's (``local_run``), dependencies between runs, pipelines of stages,
spare nodes' checks, task arrays cut at MaxArraySize, the ``stacks`` step script,
``data prepare --on-cluster``, and a submitted job's preemption rehearsed as a cluster does it
(``rehearsal``: `lmlaunch preempt`).

May import: lmcore, launcher.spec, launcher.runs, launcher.planning. Not monitoring, serving,
doctor, search, remote or commands.
"""
