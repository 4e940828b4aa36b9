"""From a validated spec and profile to a plan, without I/O: the planner, the task environment,
DeepSpeed's config, the memory plan and the notes on the mesh; and the checks that need the
training stack where it is installed (the model as transformers builds it, the memory inputs
only transformers can give). ``resolve`` is the shared front of validate, doctor, submit and the
dry run: arguments in, spec + profile + plan out. ``transport`` chooses the way to a profile's
cluster (its commands, over SSH, or its slurmrestd; ``--rest``), once for a command or a run: the one
place that does (lmcore.slurm.way answers for the way chosen).

May import: lmcore, launcher.spec, launcher.runs; lmtrain only inside functions (the runtime
extra). Not submission, monitoring or commands.
"""
