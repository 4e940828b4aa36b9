"""Checkpoints: written in the background and made durable (:mod:`.manager`, :mod:`.callback`,
:mod:`.async_checkpoint`, :mod:`.async_sharded`, :mod:`.durable`, :mod:`.writeback`), checked
(:mod:`.checksums`, :mod:`.disk_space`), resumed from on any world size (:mod:`.resume_point`,
:mod:`.elastic`, :mod:`.rng_state`, :mod:`.shard_files`, :mod:`.weights`), and exported to a
transformers directory (:mod:`.export`).
"""
