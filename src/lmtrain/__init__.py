"""lmtrain: what every SLURM task (or local process) runs, grouped by concept.

- :mod:`lmtrain.task` -- an attempt from the job script's first line to its exit code;
- :mod:`lmtrain.preemption` -- signals, the agreed stop, why an attempt ended, the requeue;
- :mod:`lmtrain.checkpoint` -- writing, checking, resuming and exporting checkpoints;
- :mod:`lmtrain.model` -- the causal LM, the LightningModule, tensor parallelism, memory facts;
- :mod:`lmtrain.distributed` -- who this rank is, the rendezvous, the strategies;
- :mod:`lmtrain.data` -- the training data: loaders, mixtures, and preparing corpora;
- :mod:`lmtrain.observe` -- what an attempt records: ledger lines, metrics, notifications;
- :mod:`lmtrain.health` -- is this rank, node or run well: preflight, node probe, hang watchdog;
- :mod:`lmtrain.local` -- ranks on this machine (``lmlaunch run --local``) and the zygote;
- :mod:`lmtrain.faults` -- the one fault-injection seam tests use.

The modules that import torch do so in their own body; the CLI imports only the torch-free ones
(the data preparation's, the token store's). docs/architecture.md draws the layers.
"""
