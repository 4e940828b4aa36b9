"""Is this rank, node and run well: checks before the ranks meet (:mod:`.preflight`), the node
probe ``lmlaunch doctor --nodes`` runs on the allocation (:mod:`.node_probe`), and the hang
watchdog that ends a rank whose step stopped moving (:mod:`.watchdog`).

What belongs here: detectors. A new one (a straggler scorer, a thermal check) goes here; what
the run does about it is the preemption package's decision.
"""
