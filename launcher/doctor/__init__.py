"""Judging a cluster against a spec before queue time is spent: doctor's checks on the login
node, the probe job on the nodes, containers, DeepSpeed's JIT ops, and rehearsals of preemption
and node failures on a real cluster (``lmlaunch preempt``).

May import: lmcore, launcher.spec, launcher.runs, launcher.planning, launcher.submit; lmtrain
only inside functions. Not monitoring's renderings, serving, search, remote or commands.
"""
