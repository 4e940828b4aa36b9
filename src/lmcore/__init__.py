"""lmcore: the shared kernel. What both the login side (``launcher``) and the runtime on the
allocation (``lmtrain``) need, and nothing else.

Belongs here: the job spec and the plan as typed records (``spec``, ``plan``, ``parallelism``,
``pipeline_stages``, ``lr_schedule``, ``container``, ``site_options``, the model-type tables);
the run directory's layout and its records, one writer and one reader for each (``run_layout``,
``rundir``, ``checkpoint_index``, ``task_records``, ``straggler_lines``, ``node_facts``,
``token_meta``); the primitives every writer uses (``atomic``, ``jsonlines``, ``errors``,
``text_rules``, ``strict_model``, ``processes``); the one owner of Optuna (``study``,
``search_spec``, ``study_storage``: a trial's rank 0 reports to the study); and the one SLURM
client (``lmcore.slurm``), which both sides ask.

May import: the standard library, pydantic, PyYAML, hostlist, xxhash, optuna (lazily). Never
``launcher`` nor ``lmtrain`` (import-linter), never torch at import time.
"""
