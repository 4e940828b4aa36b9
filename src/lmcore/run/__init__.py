"""The run directory and its records, one writer and one reader for each: the one speller of its
paths (``run_layout``, re-exported by ``rundir``), the records in it (``rundir``: the ledger, the
markers, the plan's copy; ``task_records``, ``rank_logs``, ``straggler_lines``, ``token_meta``, the
evaluator's ``eval_alongside``) and its checkpoints' index (``checkpoint_index``: which step is
complete, read without torch).

Belongs here: a file of the run directory, its name, its writer and its reader. Not here: what the
job is (lmcore.job), SLURM's records (lmcore.slurm).
"""
