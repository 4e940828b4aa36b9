"""Preparing corpora into a sharded token store (``lmlaunch data prepare``), without torch:
the inputs (:mod:`.corpus`), tokenizers (:mod:`.tokenizer`, :mod:`.tokenizer_train`), the store's
format (:mod:`.token_store`), writing one (:mod:`.build`) and one SLURM array task of a
preparation on the cluster (:mod:`.array_task`, ``python -m lmtrain.data.prepare.array_task``).

What belongs here: anything the login node may import to look at or make prepared data (numpy,
tokenizers, never torch).
"""
