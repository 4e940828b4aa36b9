"""The scale harness's ranks (``simulate:`` in a spec; docs/scale.md): lmlaunch's per-rank machinery
around a model that imports no torch and does no arithmetic, so that a hundred ranks and more run on a
few cores of the real local SLURM.

Everything a rank does to the run directory is the real code: the task record and the rendezvous
(lmtrain.distributed.task_env), the start gate, the rank log (lmtrain.task.entry), the ledger and the
heartbeat (lmtrain.observe.attempt), the timing lines (lmtrain.observe.timing_lines) and rank 0's
straggler watch, the profile poll (lmtrain.observe.profile_request), the stop flags
(lmtrain.preemption.stop_flags) and the preemption controller's decision, requeue and restart in
place, the checkpoint's checksums, completion and retention (lmtrain.checkpoint.completion) and the
resume's verification (lmtrain.checkpoint.resume_point). What stands in for torch: a step is a sleep,
a checkpoint shard is ``simulate.shard_bytes`` bytes, and the all-reduce of the stop flags and the
checkpoint's barriers go through :mod:`lmtrain.simulate.collective` (a TCP star on rank 0's
rendezvous port) instead of gloo.
"""
