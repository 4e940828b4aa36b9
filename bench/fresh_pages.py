"""What a checkpoint write costs on this machine depending on the memory the page cache grows
into — the baseline that explains bench/checkpoint_io.py's durable times.

In one process, a GPT-2 124M state (fp32 weights + AdamW state, about 1.4 GB) is written with
``torch.save`` (no fsync: only the copy into the page cache is timed, CPU time beside it)
``--saves`` times in two ways:

- ``recycled``: each file is deleted before the next save, so its just-freed pages are reused;
- ``kept``: every file stays, so each save needs pages of memory that was free until then.

On a VM whose free memory is handed back to the host, the second way pays for the first touch
of every page; a training run that keeps checkpoints is in that case. Ends with one JSON object.

    python bench/fresh_pages.py [--saves 3] [--dir /var/tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--dir", default="/var/tmp")
    a = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import transformers

    torch.set_num_threads(1)
    torch.serialization.set_crc32_options(False)  # as lmtrain's DirectCheckpointIO writes
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_positions=1024))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    ids = torch.randint(0, 1000, (1, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    state = {"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()]}
    work = Path(tempfile.mkdtemp(prefix="lmlaunch-bench-pages-", dir=a.dir))
    out: dict[str, list[dict[str, float]]] = {"recycled": [], "kept": []}
    size = 0
    try:
        for mode in ("recycled", "kept"):
            for i in range(a.saves):
                path = work / f"{mode}-{i}.pt"
                t0, c0 = time.perf_counter(), time.process_time()
                with open(path, "wb") as f:
                    torch.save(state, f)
                out[mode].append({"wall_s": round(time.perf_counter() - t0, 3),
                                  "cpu_s": round(time.process_time() - c0, 3)})
                size = path.stat().st_size
                if mode == "recycled":
                    path.unlink()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # the first recycled save has nothing to recycle yet: the later ones are the baseline
    recycled = statistics.median(x["wall_s"] for x in out["recycled"][1:] or out["recycled"])
    kept = statistics.median(x["wall_s"] for x in out["kept"][1:] or out["kept"])
    print(json.dumps({
        "bench": "fresh_pages", "bytes": size, "saves": out,
        "baseline_recycled_pages_s": recycled, "kept_files_s": kept, "ratio_kept_to_recycled": round(kept / recycled, 2),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
