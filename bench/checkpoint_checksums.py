"""What the checkpoint files' checksums cost a save: lmtrain's streamed write with its checksum
against the same write without one, on the same bytes, in the same run.

Every large checkpoint file goes through ``lmtrain.checkpoint.writeback.save_streamed`` (DDP's Lightning file,
DeepSpeed's shards, FSDP2's DCP files through the same stream), which hashes the bytes as they pass
(XXH3-128, lmtrain.checkpoint.checksums). Here a GPT-2 124M state (fp32 weights + AdamW state, about 1.4 GB,
as Lightning's checkpoint holds it) is saved ``--saves`` times each way, alternating, into a file
on ``--dir`` and fsynced (what a save costs until durable); the baseline swaps the hasher for one
that does nothing. The page cache is dropped (root) before each save.

Goal: **a save with checksums takes at most 1.05x the time of one without** (medians). Also
printed: the hash's own speed in memory (GB/s) and, for scale, what reading the file back to hash
it afterwards would cost (the other way to get the checksums). Ends with one JSON object.

    python bench/checkpoint_checksums.py [--saves 7] [--dir /var/tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GOAL = 1.05


class _NoHash:
    def update(self, data) -> None:
        pass

    def hexdigest(self) -> str:
        return "-"


def _drop_caches() -> None:
    if os.geteuid() == 0:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--saves", type=int, default=7)
    p.add_argument("--dir", default="/var/tmp")
    a = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(REPO / "src"))
    import torch
    import transformers

    from lmcore.run.checkpoint_index import file_digest
    from lmtrain.checkpoint import checksums
    from lmtrain.checkpoint.writeback import save_streamed

    torch.set_num_threads(1)
    torch.serialization.set_crc32_options(False)  # as lmtrain's DirectCheckpointIO writes
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config())
    state = {"state_dict": model.state_dict(),
             "optimizer": {k: (torch.zeros_like(v), torch.zeros_like(v)) for k, v in model.state_dict().items()}}
    real = checksums.new_hasher
    times: dict[str, list[float]] = {"checksum": [], "none": []}
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        path = Path(tmp) / "lightning.ckpt"
        for _ in range(a.saves):
            for way in ("none", "checksum"):
                checksums.new_hasher = real if way == "checksum" else _NoHash  # type: ignore[assignment]
                path.unlink(missing_ok=True)
                _drop_caches()
                t0 = time.perf_counter()
                with open(path, "wb") as f:
                    save_streamed(state, f)
                    f.flush()
                    os.fsync(f.fileno())
                times[way].append(time.perf_counter() - t0)
        checksums.new_hasher = real
        size = path.stat().st_size
        blob = path.read_bytes()
        h = real()
        t0 = time.perf_counter()
        h.update(blob)
        hash_gbps = size / (time.perf_counter() - t0) / 1e9
        del blob
        _drop_caches()
        t0 = time.perf_counter()
        file_digest(path)
        reread_s = time.perf_counter() - t0
    with_sum, without = statistics.median(times["checksum"]), statistics.median(times["none"])
    ratio = with_sum / without
    print(json.dumps({
        "bench": "checkpoint_checksums", "date": time.strftime("%Y-%m-%d"), "file_bytes": size,
        "saves": a.saves, "dir": a.dir, "algorithm": "xxh3_128",
        "save_with_checksum_s": [round(t, 3) for t in times["checksum"]],
        "save_without_s": [round(t, 3) for t in times["none"]],
        "median_with_s": round(with_sum, 3), "median_without_s": round(without, 3), "ratio": round(ratio, 3),
        "hash_in_memory_gbps": round(hash_gbps, 2), "read_back_and_hash_s": round(reread_s, 3),
        "goal": f"ratio <= {GOAL}", "meets_goal": ratio <= GOAL,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
