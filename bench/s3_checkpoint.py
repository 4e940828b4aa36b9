"""Checkpoints kept in a bucket (``checkpoint.dir: s3://...``) against the client alone, in one run on
the local cluster's Ceph RADOS Gateway (``lmlaunch cluster up --s3``).

GPT-2 124M (about 1.5 GB in Lightning's checkpoint file) trains on CPU in 2 local processes (DDP on
gloo, as bench/checkpoint_io.py) with a staged checkpoint every 2 steps kept in a bucket. From the
heartbeat and rank 0's log, for each periodic checkpoint: training held (``blocked_s``), durable on
disk (``seconds``), and in the bucket (its commit's time after that, a wait behind an older upload
included: rank 0's upload process, lmcore.objects.upload_process, sends one checkpoint at a time). Then, on the same gateway and the
same bytes, median of 3:

- ``plain_upload_s``: boto3's ``upload_file`` of the checkpoint's files, the same transfer settings,
  no commit, no checksums (the client alone);
- ``plain_upload_loaded_s``: the same, while two CPU-bound processes spin (one a core), as the two
  training ranks load the cores during a periodic upload: the like-for-like baseline of the periodic
  uploads (the gateway here shares the cores with them);
- ``plain_download_s``: boto3's ``download_file`` of the same objects;
- ``resume_read_s``: lmlaunch's read of the newest checkpoint (``CheckpointStore.download``: the commit,
  every file, each verified by xxh3 before it takes its name).

Goals (issue "Checkpoints to object storage"): held <= 0.25x the time to durable in the bucket,
durable in the bucket <= 1.2x the plain upload, the resume's read <= 1.2x the plain download. The
durable ratio is printed against both baselines: the periodic saves' (uploaded while both ranks
train on the machine's cores, which the gateway here shares) against the loaded one, and the final
checkpoint's (saved once training stopped, as a stop checkpoint at preemption is) against the quiet
one; ``meets_goal`` takes those two like-for-like pairs.

    python bench/s3_checkpoint.py [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "src"), str(REPO / "bench")]


def _uploads(run_dir: Path) -> dict[int, float]:
    """Each checkpoint's time from complete on disk to committed in the bucket (a wait behind an older
    upload included), from rank 0's log (lmtrain.checkpoint.store_mirror)."""
    out: dict[int, float] = {}
    for log in run_dir.glob("logs/attempt-*/node-0.log"):
        for m in re.finditer(r"checkpoint step-(\d+): in s3://\S+ \([\d.]+ GB; ([\d.]+)s after it was complete", log.read_text()):
            out[int(m.group(1))] = float(m.group(2))
    return out


def _spin() -> None:
    while True:
        pass


def loaded(measure, cores: int = 2) -> float:
    """``measure()`` while ``cores`` CPU-bound processes spin (the training's two ranks' load)."""
    import multiprocessing

    procs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(cores)]
    for proc in procs:
        proc.start()
    try:
        time.sleep(0.5)
        return measure()
    finally:
        for proc in procs:
            proc.kill()
            proc.join()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    import os

    import checkpoint_io
    from boto3.s3.transfer import TransferConfig

    from launcher.localcluster import object_store
    from lmcore.objects.checkpoints import PART, CheckpointStore, S3Url
    from lmcore.objects.credentials import s3_client

    checkpoint_io.require_memory("124e6")
    creds = object_store.up(lambda line: print(line, file=sys.stderr))
    client = s3_client(creds)
    bucket = f"bench-{uuid.uuid4().hex[:10]}"
    client.create_bucket(Bucket=bucket)
    work = Path(tempfile.mkdtemp(prefix="lmlaunch-bench-s3-"))
    profiles = work / "profiles"
    profiles.mkdir()
    (profiles / "local.yaml").write_text((REPO / "cluster_profiles" / "local.yaml").read_text()
                                         + f"object_store_credentials: {object_store.store_layout().credentials}\n")
    os.environ["LMLAUNCH_PROFILES_DIR"] = str(profiles)
    url = f"s3://{bucket}/bench"
    try:
        t0 = time.time()
        ckpt_dir, saves = checkpoint_io.train("jobs/gpt2-124m.yaml", (f"checkpoint.dir={url}",), work, args.steps)
        train_s = time.time() - t0
        uploads = _uploads(ckpt_dir.parent)
        last = max(x["step"] for x in saves)
        rows = [{"step": s["step"], "held_s": s["blocked_s"], "disk_s": s["seconds"], "after_disk_s": uploads[s["step"]],
                 "bucket_s": s["seconds"] + uploads[s["step"]]} for s in saves if s["step"] in uploads]
        final = next((r for r in rows if r["step"] == last), None)  # saved once training stopped: a quiet machine
        rows = [r for r in rows if r["step"] != last]
        store = CheckpointStore(client, S3Url.parse(url))
        newest = store.complete()[-1]
        local = ckpt_dir / newest
        files = sorted(f for f in local.rglob("*") if f.is_file())
        size = sum(f.stat().st_size for f in files)
        config = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=store.workers)

        def plain_upload() -> float:
            t = time.perf_counter()
            for f in files:
                client.upload_file(str(f), bucket, f"plain/{f.relative_to(local)}", Config=config)
            return time.perf_counter() - t

        def plain_download(dest: Path) -> float:
            t = time.perf_counter()
            for f in files:
                (dest / f.relative_to(local)).parent.mkdir(parents=True, exist_ok=True)
                client.download_file(bucket, f"plain/{f.relative_to(local)}", str(dest / f.relative_to(local)), Config=config)
            return time.perf_counter() - t

        def resume_read(dest: Path) -> float:
            t = time.perf_counter()
            store.download(newest, dest)
            return time.perf_counter() - t

        up, up_loaded, down, read = [], [], [], []
        for i in range(3):  # alternated, each into a fresh directory
            up.append(plain_upload())
            up_loaded.append(loaded(plain_upload))
            first, second = (plain_download, resume_read) if i % 2 == 0 else (resume_read, plain_download)
            for fn in (first, second):
                dest = work / f"read-{i}-{fn.__name__}"
                (down if fn is plain_download else read).append(fn(dest))
                shutil.rmtree(dest)
        held = statistics.median(r["held_s"] for r in rows)
        bucket_s = statistics.median(r["bucket_s"] for r in rows)
        result = {
            "bench": "s3_checkpoint", "steps": args.steps, "train_s": round(train_s, 1), "checkpoint_bytes": size,
            "files": len(files), "saves": rows, "held_s": held, "durable_in_bucket_s": bucket_s,
            "plain_upload_s": statistics.median(up), "plain_upload_loaded_s": statistics.median(up_loaded),
            "plain_download_s": statistics.median(down), "resume_read_s": statistics.median(read),
            "runs": {"plain_upload": up, "plain_upload_loaded": up_loaded, "plain_download": down, "resume_read": read},
        }
        result["held_vs_durable"] = held / bucket_s
        result["durable_vs_plain_upload"] = bucket_s / result["plain_upload_s"]
        result["durable_vs_plain_upload_loaded"] = bucket_s / result["plain_upload_loaded_s"]
        result["read_vs_plain_download"] = result["resume_read_s"] / result["plain_download_s"]
        if final is not None:
            result["final"] = final
            result["final_vs_plain_upload"] = final["bucket_s"] / result["plain_upload_s"]
        result["meets_goal"] = (result["held_vs_durable"] <= 0.25 and result["durable_vs_plain_upload_loaded"] <= 1.2
                                and result.get("final_vs_plain_upload", 9.0) <= 1.2 and result["read_vs_plain_download"] <= 1.2)
        print(json.dumps(result))
    finally:
        object_store.remove_bucket(client, bucket)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
