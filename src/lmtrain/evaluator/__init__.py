"""The evaluator alongside the training (``eval.alongside``): the second component of the run's
SLURM heterogeneous job, scoring each complete checkpoint with lm-evaluation-harness while the
trainer trains.

:mod:`.main` (``python -m lmtrain.evaluator.main RUN_DIR``: what the evaluator's srun starts, and
``lmlaunch eval``'s job) watches the run's checkpoints and records each checkpoint's scores
(lmcore.run.eval_alongside: which one next, the records); :mod:`.harness` turns a checkpoint into a
transformers model directory (lmtrain.checkpoint.export, any strategy) and runs lm-eval on it;
:mod:`.shipped` puts the shipped local tasks (``tasks/``) where lm-eval can read them.

What belongs here: what the evaluator does. It imports the checkpoint package and the kernel; the
trainer (lmtrain.task) and the evaluator never import each other.
"""
