"""torch.save's zip CRC32 in a checkpoint file's write: the project's writer (lmtrain.checkpoint.writeback.save_streamed,
which leaves the CRC32 out) against the same writer with torch's CRC32 on, and dd of the same bytes,
alternated in one run on one filesystem, each write fsynced, the page cache dropped before each (root).

    python bench/zip_crc.py [--gb 1.5] [--repeat 3] [--dir /var/tmp]

Prints one JSON object: the median seconds of each and the ratios to dd's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def _drop_caches() -> None:
    with contextlib.suppress(OSError):
        Path("/proc/sys/vm/drop_caches").write_text("3\n")


def _write(state: dict, path: Path, crc: bool) -> float:
    import torch

    from lmtrain.checkpoint import writeback
    from lmtrain.checkpoint.durable import fsync_file

    keep = writeback._no_zip_crc32
    if crc:  # the writer as it was: torch's setting left alone
        writeback._no_zip_crc32 = lambda _torch: contextlib.nullcontext()  # type: ignore[assignment]
    try:
        _drop_caches()
        t = time.perf_counter()
        with open(path, "wb") as f:
            writeback.save_streamed(state, f)
            f.flush()
        fsync_file(path)
        return time.perf_counter() - t
    finally:
        writeback._no_zip_crc32 = keep
        assert torch.serialization.get_crc32_options()
        path.unlink()


def _dd(path: Path, nbytes: int) -> float:
    _drop_caches()
    t = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=64M", f"count={max(1, nbytes >> 26)}", "conv=fsync"],
                   check=True, capture_output=True)
    s = time.perf_counter() - t
    path.unlink()
    return s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=1.5, help="the state's size (fp32 tensors of random values)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: the system temp directory)")
    args = p.parse_args()
    import torch

    n = int(args.gb * 1e9 / 4)
    state = {"weights": torch.randn(n // 3), "exp_avg": torch.randn(n // 3), "exp_avg_sq": torch.rand(n - 2 * (n // 3))}
    nbytes = 4 * n
    times: dict[str, list[float]] = {"without_crc32": [], "with_crc32": [], "dd": []}
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        f = Path(d) / "state.pt"
        for r in range(args.repeat):
            order = ["without_crc32", "with_crc32", "dd"] if r % 2 == 0 else ["dd", "with_crc32", "without_crc32"]
            for name in order:
                times[name].append(_dd(f, nbytes) if name == "dd" else _write(state, f, crc=name == "with_crc32"))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({"bench": "zip_crc", "bytes": nbytes, "repeat": args.repeat, "cpu_count": os.cpu_count(),
                      "seconds": times, "median_s": med, "without_crc32_vs_dd": med["without_crc32"] / med["dd"],
                      "with_crc32_vs_dd": med["with_crc32"] / med["dd"],
                      "without_vs_with": med["without_crc32"] / med["with_crc32"]}))


if __name__ == "__main__":
    main()
