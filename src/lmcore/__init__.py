"""lmcore: the shared kernel. What both the login side (``launcher``) and the runtime on the
allocation (``lmtrain``) need, and nothing else.

Five packages, each saying what belongs in it:

- ``lmcore.job``: what a job is, the spec and the plan as typed records and the rules of their fields;
- ``lmcore.run``: the run directory's layout and its records, one writer and one reader for each,
  and its checkpoints' index;
- ``lmcore.search``: the one owner of Optuna (a trial's rank 0 reports to the study);
- ``lmcore.slurm``: the one SLURM client, which both sides ask, and the ways to reach it;
- ``lmcore.objects``: object storage (S3): credentials, the client, checkpoints in a bucket.

At the root, only the primitives every package uses: ``errors`` (the typed errors and exit codes),
``text_rules`` (what a name, a path or a line of text may hold),
``atomic`` and ``jsonlines`` (durable writes), ``digests`` (a file's checksum), ``processes``, ``node_facts`` (a node's hardware as
the doctor and the runtime's probe read it).

May import: the standard library, pydantic, PyYAML, hostlist, xxhash, optuna and boto3 (lazily). Never
``launcher`` nor ``lmtrain`` (import-linter), never torch at import time.
"""
