"""Ranks on this machine: ``lmlaunch run --local`` starts N processes with the same entry as a
SLURM task (:mod:`.launch`), forked from an interpreter that already imported the frameworks
when it can (:mod:`.zygote`, the client; :mod:`.zygote_serve`, the server).
"""
