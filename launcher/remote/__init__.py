"""Commands from a workstation: ``--remote NAME`` forwarded over OpenSSH (lmcore.slurm.ssh, the one owner of ssh),
the lean read-only path that ships nothing, and the warm lmlaunch on the login node that answers
forwarded read-only commands in-process.

May import: lmcore, launcher.spec, launcher.runs, launcher.context. Not the commands (the CLI's
entry is injected through Context.entry).
"""
