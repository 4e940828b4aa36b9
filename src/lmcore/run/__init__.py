"""The run directory and its records, one writer and one reader for each: the one speller of its
paths (``run_layout``, re-exported by ``rundir``), the records in it (``rundir``: the ledger, the
markers, the plan's copy; ``task_records``, ``rank_logs``, ``straggler_lines``, ``token_meta``, the
evaluator's ``eval_alongside``), its checkpoints' index (``checkpoint_index``: which step is
complete, read without torch), one of its checkpoints brought from its bucket (``bucket_fetch``),
and the end line written for an attempt nobody in the job could end (``lost_batch_host``: its batch script's node failed; the keeper's and the watcher's one decision).

Belongs here: a file of the run directory, its name, its writer and its reader. Not here: what the
job is (lmcore.job), SLURM's records (lmcore.slurm).
"""
