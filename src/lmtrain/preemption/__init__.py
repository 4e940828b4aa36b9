"""Preemption, time limits and requeue (read the modules in this order):

- :mod:`.signals` -- torch-free: the handlers that only record, the :class:`~.signals.StopRequest`;
- :mod:`.policy` -- pure: why an attempt ended, whether the job runs again, the start gate;
- :mod:`.slurm_facts` -- what SLURM says, asked from the main loop; :mod:`.first_death`,
  :mod:`.bad_nodes` -- who died first, which nodes a requeue keeps off;
- :mod:`.gate` -- the start gate's I/O (rank 0 decides, every rank reads the answer);
- :mod:`.agreement` -- the stop agreed at a step boundary (the only part that imports Lightning);
- :mod:`.controller` -- one attempt's preemption handling, wired in by :mod:`lmtrain.task.entry`.

One owner of signals, a stop agreed at a step boundary,
a complete checkpoint, then one decision (rank 0) about why the attempt ended and whether the
job requeues itself.

The path of a stop (docs/run-directory.md for the ledger):

1. :class:`lmtrain.preemption.signals.SignalOwner` installs handlers for the warning signal (``plan.preemption.signal``,
   USR2 by default) and SIGTERM in the training process only. They are installed when the
   task starts and installed again in ``on_train_start``, after Lightning's ``Trainer.fit``
   registered its own SIGTERM handler (which does a collective inside the handler and would
   deadlock when ranks get the signal at different times): from then on ours are the only
   ones. A handler records the signal (which, when) and calls ``StopRequest.request``; it does
   no I/O and no collective. In any other process (a forked DataLoader worker inherits the
   handlers) it does nothing, and DataLoader workers ignore both signals
   (:class:`lmtrain.preemption.signals.WorkerSignalGuard`: torch's own worker SIGTERM handler would kill them and crash
   the training process before it reaches the step boundary).
2. :class:`lmtrain.preemption.agreement.StopAgreement`, at every optimizer-step boundary, runs ONE all-reduce (MAX) of a
   4-number tensor ``[stop requested, SIGTERM seen, warning seen, -first signal time]``: every
   rank learns at the same step that some rank was asked to stop, and which signals arrived
   where. All ranks then take part in the checkpoint (CheckpointManager.save: COMPLETE after
   every rank finished, ``latest`` last) and the Trainer stops.
3. After the fit, rank 0 decides (:func:`lmtrain.preemption.policy.decide`) the ledger reason from the signals, the run's markers
   (``CANCELLED``, ``DONE``), the job's SLURM state (``lmcore.slurm.client``, from the main loop,
   never from the handler: :mod:`lmtrain.preemption.slurm_facts`) and the loop guards; the ledger ``end`` line is written; then
   :meth:`lmtrain.preemption.controller.Preemption.after_end` calls ``scontrol requeue`` LAST when the job must requeue
   itself (a time limit; a stop whose job SLURM is not already requeueing).
4. At the start of the next attempt :func:`lmtrain.preemption.policy.start_gate` (rank 0, before the rendezvous, its
   answer published for the other ranks) records a previous attempt that has no ``end`` line
   (node failure / SIGKILL) and ends at once, without training, an attempt of a run that is
   ``DONE`` or ``CANCELLED`` or over a loop guard.
"""
