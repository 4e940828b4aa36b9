"""The training data: token windows, the resumable sampler and loaders (:mod:`.loader`), a
weighted mixture of prepared stores (:mod:`.mixture`), and preparing corpora into token stores
(:mod:`.prepare`, torch-free: the CLI imports it).

What belongs here: where a batch comes from. A new data source or format goes here.
"""
