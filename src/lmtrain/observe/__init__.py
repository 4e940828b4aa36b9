"""What an attempt records and tells: the ledger's start and end lines and per-attempt records
(:mod:`.attempt`), the startup phases (:mod:`.startup`), the step metrics and heartbeat
(:mod:`.callbacks`, :mod:`.loggers`), the environment a run trained in
(:mod:`.environment_record`) and the notifications (:mod:`.notify`).

What belongs here: anything that writes what happened for a reader (a person, ``lmlaunch
status``, an exporter); a new logger or a new per-rank record goes here. Nothing here decides
what the run does next (that is preemption's and health's).
"""
