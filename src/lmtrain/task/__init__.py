"""An attempt, from the job script's first line to its exit code.

:mod:`.main` (``python -m lmtrain.task.main``: owns the signals, runs submitit's runner) calls
:class:`.train_task.TrainTask` (the picklable callable submitted), which calls
:func:`.entry.run_task`: imports, the start gate and the rendezvous, the rank's log; then
:func:`.training.train` (resume point, preflight, the fit, the end line) or :mod:`.evaluate`
(an eval job). :mod:`.fit` builds the Trainer and runs it.

What belongs here: the order in which an attempt does things. What it does at each step lives in
the package that owns the concept (checkpoint, preemption, observe, health, ...).
"""
