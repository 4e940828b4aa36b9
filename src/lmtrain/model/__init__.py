"""The model and what it holds: the transformers causal LM built from the spec
(:mod:`.causal_lm`), the LightningModule that trains it (:mod:`.module`), its tensor-parallel
plan (:mod:`.tensor_parallel`: it knows the model's blocks), and the facts of its memory
(:mod:`.memory_facts` for the login side's plan, :mod:`.memory_held` measured on a rank).

What belongs here: the model's code, its loss, optimizer and schedule, and how its layers split.
How ranks meet and which Lightning strategy wraps it live in :mod:`lmtrain.distributed`.
"""
