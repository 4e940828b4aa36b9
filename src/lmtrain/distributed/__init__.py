"""Many ranks as one: who this rank is, the rendezvous, the collective timeout and parting at the
end (:mod:`.task_env`), the Lightning strategies lmtrain builds (:mod:`.strategies`), and
DeepSpeed's JIT-built ops (:mod:`.jit_ops`).

What belongs here: how ranks meet, talk and part, and the strategy that wraps the model. The next
strategy goes here; a parallelism that must know the model's blocks (tensor parallelism today)
lives beside the model, in :mod:`lmtrain.model`.
"""
