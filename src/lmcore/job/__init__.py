"""What a job is, as both sides read it: the spec (``spec``: one pydantic model per section, with
the rules it keeps: ``strict_model``, and lmcore.text_rules), the model-type tables (``model_types``,
``model_config``), the parallel layout and its stages (``parallelism``, ``pipeline_stages``), the
learning-rate schedule (``lr_schedule``), the network's and the container's plans (``network``,
``container`` with the podman task's shell script beside it), a site's own sbatch options
(``site_options``) and the plan the launcher writes and the runtime reads (``plan``).

Belongs here: a typed record of the job or its plan, and a rule about its fields. Not here: reading
or writing the run directory (lmcore.run), asking SLURM (lmcore.slurm), searches (lmcore.search).
"""
