"""Searches: the one owner of Optuna. A search's spec (``search_spec``), its study (``study``: the
launcher asks it for trials, a trial's rank 0 reports to it) and the study's storage
(``study_storage``: one journal file or a database URL).

Belongs here: what both the launcher and a trial's rank need of a search. Not here: placing the
trials on the cluster (launcher.search).
"""
