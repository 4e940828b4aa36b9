"""Runs on the login node: the registry of submitted runs and their directories, the run's code
snapshot (the packages the attempts import), and the user's lmlaunch home
(``$LMLAUNCH_HOME``).

May import: lmcore only (the bottom layer of the launcher).
"""
