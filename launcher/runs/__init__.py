"""Runs on the login node: the registry of submitted runs and their directories (one change of a
run at a time: its lock), the run's code
snapshot (the packages the attempts import), and the user's lmlaunch home
(``$LMLAUNCH_HOME``).

May import: lmcore only (the bottom layer of the launcher).
"""
