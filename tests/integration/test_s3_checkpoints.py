"""Checkpoints in a bucket (lmcore.objects.checkpoints) on the local cluster's real Ceph RADOS Gateway:
uploaded in parallel (multipart for a large file) to keys of their own, complete only with their commit
object, read back verified; two uploads of one checkpoint leave one; an upload cut by the gateway's death
is never complete and retention clears it; retention keeps exactly keep_last and aborts what is left.

The store is started as `cluster up --s3` starts it (launcher.localcluster.object_store.up); each test
works in a bucket of its own and removes it."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from launcher.localcluster import object_store
from lmcore.errors import UserError
from lmcore.objects.checkpoints import COMMIT_SUFFIX, PART, CheckpointStore, ObjectStoreError, S3Url
from lmcore.objects.credentials import Credentials, s3_client
from tests import gateway
from tests.waiting import HANG_S, until


def _bucket_store() -> Iterator[CheckpointStore]:
    creds = object_store.up(lambda line: None)
    client = s3_client(creds)
    bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    yield CheckpointStore(client, S3Url.parse(f"s3://{bucket}/runs/demo/checkpoints"), workers=4)
    object_store.up(lambda line: None)  # running again whatever the test did to it
    object_store.remove_bucket(client, bucket)


@pytest.fixture
def store():
    """A bucket of the test's own on the gateway, which other tests use meanwhile."""
    with gateway.shared():
        yield from _bucket_store()


@pytest.fixture
def store_alone():
    """The same, for a test that kills the gateway: no other test uses it meanwhile."""
    with gateway.alone():
        yield from _bucket_store()


def _checkpoint(root: Path, step: int, big: int = 0) -> Path:
    d = root / f"local-step-{step}"
    (d / "weights").mkdir(parents=True)
    (d / "meta.json").write_text(f'{{"step": {step}}}\n')
    (d / "weights" / "rank-0.pt").write_bytes(os.urandom(3 << 20))
    (d / "weights" / "rank-1.pt").write_bytes(os.urandom(1 << 20) + bytes([step % 256]))
    if big:
        (d / "optimizer.pt").write_bytes(os.urandom(big))
    (d / "COMPLETE").write_text("")
    return d


def _same_tree(a: Path, b: Path) -> bool:
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    return files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file()) and all(
        (a / f).read_bytes() == (b / f).read_bytes() for f in files)


def test_an_uploaded_checkpoint_is_complete_by_its_commit_and_reads_back_verified(store, tmp_path):
    local = _checkpoint(tmp_path, 10, big=PART + (5 << 20))  # one multipart file (two parts)
    commit = store.upload(local, "step-10")
    assert store.complete() == ["step-10"] and commit.bytes == sum(p.stat().st_size for p in local.rglob("*") if p.is_file())
    back = tmp_path / "back"
    store.download("step-10", back)
    assert _same_tree(local, back)

    # a second upload of the same checkpoint (a retried save) loses to the first: one commit, its files only
    again = store.upload(local, "step-10")
    assert again.token == commit.token
    keys = list(store._keys(store._key("step-10") + "/"))
    assert len(keys) == len(commit.files)
    assert all(k.removeprefix(store._key("step-10") + "/").split("/")[0] == commit.token for k in keys)

    # an object changed behind the store's back is refused by name, and nothing takes the file's name
    key = commit.files["weights/rank-1.pt"]["key"]
    store.client.put_object(Bucket=store.url.bucket, Key=key, Body=b"not the weights")
    elsewhere = tmp_path / "elsewhere"
    with pytest.raises(ObjectStoreError, match="rank-1.pt: 15 bytes"):
        store.download("step-10", elsewhere)
    assert not (elsewhere / "weights" / "rank-1.pt").exists()


def test_an_upload_cut_by_the_gateways_death_is_never_complete_and_retention_clears_it(store_alone, tmp_path):
    store = store_alone
    store.upload(_checkpoint(tmp_path, 5), "step-5")
    cut = _checkpoint(tmp_path, 10, big=6 * PART)  # several parts in flight when the gateway dies
    failed: list[BaseException] = []

    def upload() -> None:
        try:
            store.upload(cut, "step-10")
        except ObjectStoreError as exc:
            failed.append(exc)

    t = threading.Thread(target=upload)
    t.start()
    layout = object_store.store_layout()
    uploads = lambda: store.client.list_multipart_uploads(Bucket=store.url.bucket).get("Uploads", [])  # noqa: E731
    until(uploads, progress=lambda: t.is_alive(), what="the optimizer's multipart upload to start")
    os.kill(object_store.running(layout, "client.rgw.a"), signal.SIGKILL)
    until(lambda: not t.is_alive(), progress=lambda: len(failed), what="the cut upload to fail")
    assert failed, "the upload finished though the gateway died under it"
    object_store.up(lambda line: None)
    assert store.complete() == ["step-5"]  # never complete: no commit

    store.upload(_checkpoint(tmp_path, 15), "step-15")
    removed = store.retain(keep_last=2)
    assert removed.checkpoints == () and store.complete() == ["step-5", "step-15"]
    assert not uploads() and not list(store._keys(store._key("step-10") + "/"))


def test_retention_keeps_exactly_keep_last_and_leaves_an_upload_under_way(store, tmp_path):
    for step in (10, 20, 30, 40):
        store.upload(_checkpoint(tmp_path, step), f"step-{step}")
    # an upload of step 50 under way (a multipart upload begun, nothing committed) is newer than all
    under_way = store._key("step-50", "t0", "optimizer.pt")
    upload_id = store.client.create_multipart_upload(Bucket=store.url.bucket, Key=under_way)["UploadId"]
    # an abandoned upload of step 25 (its saver died): older than the newest complete one
    abandoned = store._key("step-25", "t0", "meta.json")
    store.client.put_object(Bucket=store.url.bucket, Key=abandoned, Body=b"{}")
    removed = store.retain(keep_last=2)
    assert removed.checkpoints == ("step-10", "step-20") and store.complete() == ["step-30", "step-40"]
    left = set(store._keys(store._key() + "/"))
    assert not any("/step-10" in k or "/step-20" in k or "/step-25" in k for k in left)
    assert {k for k in left if k.endswith(COMMIT_SUFFIX)} == {store._key(f"step-{s}{COMMIT_SUFFIX}") for s in (30, 40)}
    open_uploads = store.client.list_multipart_uploads(Bucket=store.url.bucket).get("Uploads", [])
    assert [(u["Key"], u["UploadId"]) for u in open_uploads] == [(under_way, upload_id)]


def test_credentials_readable_by_others_are_refused_and_no_key_is_ever_shown(tmp_path):
    creds = Credentials("http://127.0.0.1:7480", "AKEXAMPLE", "SECRETEXAMPLE")
    path = tmp_path / "s3.json"
    path.write_text(creds.to_json())
    path.chmod(0o644)
    with pytest.raises(UserError, match=r"mode 644; it must be readable by its owner only \(chmod 600"):
        Credentials.read(path)
    path.chmod(0o600)
    back = Credentials.read(path)
    assert back == creds and "SECRET" not in repr(back) and "AKEXAMPLE" not in repr(back)
    with pytest.raises(UserError, match="not an S3 location"):
        S3Url.parse("s3://Bad_Bucket/x")
    assert S3Url.parse("s3://lmlaunch/runs/a/") == S3Url("lmlaunch", "runs/a")


def test_a_run_keeps_its_checkpoints_in_the_bucket_and_resumes_from_it_bit_identical(store, tmp_path, repo):
    """`checkpoint.dir: s3://...` through the entry a SLURM task runs (`lmlaunch run --local`, 2 ranks):
    each complete checkpoint is uploaded by rank 0, keep_last holds in the bucket; with the disk's
    checkpoints gone, `--resume` downloads the newest from the bucket, verified, and ends with weights
    identical to the same run resumed from its disk."""
    import io
    import json

    from launcher.cli import main
    from launcher.context import Context

    creds = object_store.store_layout().credentials
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    local = (repo / "cluster_profiles" / "local.yaml").read_text()
    (profiles / "local.yaml").write_text(local + f"object_store_credentials: {creds}\n")  # `run --local`'s profile
    runs = tmp_path / "runs"
    env = {"LMLAUNCH_RUNS_ROOT": str(runs), "LMLAUNCH_PROFILES_DIR": str(profiles)}
    common = ["checkpoint.every_n_steps=4", "checkpoint.keep_last=2", "trainer.val_check_interval=null",
              "trainer.max_steps=12"]

    def run(*args: str) -> str:
        out = io.StringIO()
        code = main(["run", str(repo / "jobs" / "tiny-cpu.yaml"), "--local", *args], Context(stdout=out, stderr=out, environ=env))
        assert code == 0, out.getvalue()[-4000:]
        return out.getvalue()

    # the same run with its checkpoints on disk only: 8 steps, then resumed to 12 (--max-steps 8 plans the
    # schedule for 8: both runs continue the same way)
    run("--name", "disk", "--max-steps", "8", *common, f"checkpoint.dir={tmp_path / 'disk-ckpt'}")
    run("--name", "disk", "--resume", *common, f"checkpoint.dir={tmp_path / 'disk-ckpt'}")
    bucket_dir = f"s3://{store.url.bucket}/runs/cut"
    run("--name", "cut", "--max-steps", "8", *common, f"checkpoint.dir={bucket_dir}")
    cut = CheckpointStore(store.client, S3Url.parse(bucket_dir))
    assert cut.complete() == ["step-4", "step-8"]
    plan = json.loads((runs / "cut" / "plan.json").read_text())
    assert plan["paths"]["checkpoint_store"] == bucket_dir and plan["paths"]["checkpoint_dir"] == str(runs / "cut" / "checkpoints")
    for step in (4, 8):  # the disk loses them: only the bucket has the run's checkpoints
        shutil.rmtree(runs / "cut" / "checkpoints" / f"step-{step}")
    said = run("--name", "cut", "--resume", *common, f"checkpoint.dir={bucket_dir}")
    assert f"resuming from step-8 in {bucket_dir} (this disk has none: the attempt downloads it)" in said, said[-3000:]
    assert f"checkpoint step-8: downloaded from {bucket_dir}" in said  # rank 0, before its log is set up
    assert cut.complete() == ["step-8", "step-12"]  # keep_last in the bucket
    import torch

    def weights(ckpt: Path) -> dict:
        return torch.load(next(ckpt.rglob("*.ckpt")), map_location="cpu", weights_only=False)["state_dict"]

    disk, resumed = weights(tmp_path / "disk-ckpt" / "step-12"), weights(runs / "cut" / "checkpoints" / "step-12")
    assert disk.keys() == resumed.keys() and all(torch.equal(disk[k], resumed[k]) for k in disk)
    # its export reads the bucket's checkpoint when the disk lost it
    shutil.rmtree(runs / "cut" / "checkpoints" / "step-12")
    out = io.StringIO()
    code = main(["export", str(runs / "cut"), "--to", "hf", str(tmp_path / "hf")], Context(stdout=out, stderr=out, environ=env))
    assert code == 0, out.getvalue()[-3000:]
    assert f"note: checkpoint step-12: downloaded from {bucket_dir}" in out.getvalue(), out.getvalue()
    assert (tmp_path / "hf" / "config.json").is_file()
    # `lmlaunch eval` scores the bucket's checkpoints: the job asks for both, its evaluator downloads them
    for step in (8, 12):
        shutil.rmtree(runs / "cut" / "checkpoints" / f"step-{step}", ignore_errors=True)
    out = io.StringIO()
    code = main(["eval", str(runs / "cut"), "--dry-run"], Context(stdout=out, stderr=out, environ=env))
    assert code == 0 and "--once --steps 8,12" in out.getvalue(), out.getvalue()[-3000:]
    from lmcore.run.checkpoint_index import complete_checkpoints, verify
    from lmcore.run.eval_alongside import EvaluatorPlan
    from lmtrain.evaluator.main import Evaluator

    ev = EvaluatorPlan(partition="low", nodes=1, cpus_per_task=1, gpus=0, gres=None, mem=None, tasks=("t",))
    evaluator = Evaluator(runs / "cut", plan, ev, once=True, steps=None)
    evaluator.from_bucket()
    assert [c.step for c in complete_checkpoints(runs / "cut" / "checkpoints")] == [8, 12]
    assert not verify(runs / "cut" / "checkpoints" / "step-8")
    # no credential in anything the run wrote
    secret = json.loads(creds.read_text())["secret_key"]
    for f in (runs / "cut").rglob("*"):
        if f.is_file() and f.stat().st_size < 50 << 20:
            assert secret.encode() not in f.read_bytes(), f


def test_every_rank_of_a_sharded_checkpoint_uploads_its_own_files(store, tmp_path, repo):
    """FSDP2 on 2 local ranks, `checkpoint.dir: s3://...`: rank 1 uploads the files it wrote (its DCP
    shard, its rank file) as soon as they are written, with a marker that lists them; rank 0's upload
    of the complete checkpoint takes them as they are and sends the rest; the commit names both
    uploads, retention keeps both and deletes a dropped checkpoint's published files with it, and
    the newest reads back verified."""
    import io

    from launcher.cli import main
    from launcher.context import Context
    from lmcore.objects.checkpoints import MARKER_PREFIX

    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "local.yaml").write_text((repo / "cluster_profiles" / "local.yaml").read_text()
                                         + f"object_store_credentials: {object_store.store_layout().credentials}\n")
    env = {"LMLAUNCH_RUNS_ROOT": str(tmp_path / "runs"), "LMLAUNCH_PROFILES_DIR": str(profiles)}
    url = f"s3://{store.url.bucket}/runs/sharded"
    out = io.StringIO()
    code = main(["run", str(repo / "jobs" / "tiny-cpu.yaml"), "--local", "--name", "sharded", "trainer.strategy=fsdp",
                 "checkpoint.every_n_steps=4", "checkpoint.keep_last=2", "trainer.val_check_interval=null",
                 "trainer.max_steps=12", f"checkpoint.dir={url}"], Context(stdout=out, stderr=out, environ=env))
    assert code == 0, out.getvalue()[-4000:]
    bucket = CheckpointStore(store.client, S3Url.parse(url))
    assert bucket.complete() == ["step-8", "step-12"]
    for name in ("step-8", "step-12"):
        commit = bucket.commit(name)
        published = bucket.published(name)
        assert sorted(published) == [1], published  # rank 1's marker; rank 0's files go with the commit
        mine = published[1]
        assert "rank-1.pt" in mine and any(rel.endswith("__1_0.distcp") for rel in mine), mine
        for rel, entry in commit.files.items():
            token = entry["key"].removeprefix(bucket._key(name) + "/").split("/")[0]
            assert (token != commit.token) == (rel in mine), (rel, token, commit.token)
            if rel in mine:
                assert mine[rel] == entry
    assert not list(bucket._keys(bucket._key("step-4") + "/")), "the dropped checkpoint's published files are left"
    assert any(k.rsplit("/", 1)[-1] == f"{MARKER_PREFIX}1.json" for k in bucket._keys(bucket._key("step-12") + "/"))
    back = tmp_path / "back"
    bucket.download("step-12", back)
    local = tmp_path / "runs" / "sharded" / "checkpoints" / "step-12"
    assert sorted(p.relative_to(back).as_posix() for p in back.rglob("*") if p.is_file()) == sorted(bucket.commit("step-12").files)
    assert all((back / rel).read_bytes() == (local / rel).read_bytes() for rel in bucket.commit("step-12").files)
    logs = "".join(p.read_text() for p in (tmp_path / "runs" / "sharded" / "logs").rglob("*.log"))
    assert "checkpoint step-12: rank 1's" in logs and "files in s3://" in logs, logs[-3000:]


def test_refused_credentials_and_a_full_quota_cost_the_upload_never_the_run_nor_the_secret(store, tmp_path, caplog):
    """The mirror's uploads (lmtrain.checkpoint.store_mirror) against a gateway that refuses: keys it
    does not know, then a bucket quota smaller than the checkpoint. Each costs that upload (logged with
    S3's reason, the step not in the bucket, nothing of it complete there) and nothing else; no log line
    holds the secret key."""
    import json
    import logging
    from types import SimpleNamespace

    from lmtrain.checkpoint.store_mirror import StoreMirror

    layout = object_store.store_layout()
    good = Credentials.read(layout.credentials)
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"endpoint": good.endpoint, "access_key": good.access_key,
                                 "secret_key": "not-" + good.secret_key, "bucket": store.url.bucket}))
    wrong.chmod(0o600)
    url = f"s3://{store.url.bucket}/mirror"

    def mirror(creds: Path) -> StoreMirror:
        plan = SimpleNamespace(paths=SimpleNamespace(checkpoint_store=url, checkpoint_store_credentials=str(creds)))
        return StoreMirror(plan, keep_last=2)

    caplog.set_level(logging.INFO, logger="lmtrain.checkpoint.store_mirror")
    refused = mirror(wrong)
    refused.submit(_checkpoint(tmp_path, 10).rename(tmp_path / "step-10"))  # as the checkpoint directory names it
    assert refused.close(wait_s=HANG_S) and 10 in refused.failed and not refused.pending
    assert "SignatureDoesNotMatch" in refused.failed[10], refused.failed

    admin = ["radosgw-admin", "-c", str(layout.conf), "-n", "client.rgw.a"]
    object_store._run([*admin, "quota", "set", "--quota-scope=bucket", f"--bucket={store.url.bucket}", "--max-size=1048576"],
                      "quota set")
    object_store._run([*admin, "quota", "enable", "--quota-scope=bucket", f"--bucket={store.url.bucket}"], "quota enable")
    full = mirror(layout.credentials)
    full.submit(_checkpoint(tmp_path, 20).rename(tmp_path / "step-20"))  # 4 MB against a 1 MiB quota
    assert full.close(wait_s=HANG_S) and 20 in full.failed
    assert "QuotaExceeded" in full.failed[20], full.failed
    assert CheckpointStore(store.client, S3Url.parse(url)).complete() == []
    assert "not uploaded" in caplog.text and good.secret_key not in caplog.text


def test_a_stop_checkpoint_the_gateway_never_got_is_not_resumed_from_and_the_run_completes_after(
        store_alone, slurm_cluster, lm_env, own_jobs, repo):
    """On the real cluster: the gateway SIGKILLed before a preemption, so the stop checkpoint never
    reaches the bucket (the attempt's end line and `history` say so); the disk then loses its
    checkpoints (as a node's disk, or a move to a cluster with none); once the gateway is back the
    requeued attempt resumes from the bucket's newest complete checkpoint, never the one it lacks,
    and the run ends with every step's loss and the final weights of the uninterrupted run, the
    bucket holding exactly keep_last complete checkpoints and no upload left open."""
    import json

    from preempt_helpers import (
        EVERY,
        MAX_STEPS,
        assert_losses_match,
        assert_weights_identical,
        ddp_reference,
        ends,
        finish,
        held_at,
        lm,
        preempt,
        starts,
        submit,
        wait_held,
    )
    from shared_results import shared
    from slurm_helpers import job_name

    store = store_alone
    profiles = Path(lm_env["LMLAUNCH_HOME"]) / "profiles"
    profiles.mkdir(parents=True, exist_ok=True)
    (profiles / "local.yaml").write_text((repo / "cluster_profiles" / "local.yaml").read_text()
                                         + f"object_store_credentials: {object_store.store_layout().credentials}\n")
    env = {**lm_env, "LMLAUNCH_PROFILES_DIR": str(profiles)}
    reference = shared("preempt-ddp-reference", lambda: ddp_reference(lm_env, own_jobs))
    name, url = job_name("s3", "cut"), f"s3://{store.url.bucket}/runs/stop"
    stop_at = 2 * EVERY + 5
    job, run_dir = submit(env, name, f"checkpoint.dir={url}", holds=(held_at(stop_at),))
    own_jobs.append(job)
    wait_held(run_dir, stop_at)
    bucket = CheckpointStore(store.client, S3Url.parse(url))
    until(lambda: bucket.complete() == [f"step-{EVERY}", f"step-{2 * EVERY}"], progress=lambda: len(bucket.complete()),
          what="the periodic checkpoints in the bucket")
    os.kill(object_store.running(object_store.store_layout(), "client.rgw.a"), signal.SIGKILL)
    assert preempt(env, name, "requeue")["requeued"]
    until(lambda: ends(run_dir), progress=lambda: (run_dir / "attempts.jsonl").stat().st_size,
          what="the preempted attempt's end line")
    stop = ends(run_dir)[0]
    assert stop["reason"] == "preempted" and stop["end_step"] == stop_at, stop
    assert stop["bucket"]["step"] == stop_at and stop["bucket"]["uploaded"] is False, stop
    assert "127.0.0.1:7480" in stop["bucket"]["error"], stop
    code, out, err = lm(env, "status", name, "--json")  # requeued, waiting for its BeginTime
    assert f"checkpoint step-{stop_at} is not in {url} (" in json.loads(out)["runs"][0]["note"], out + err
    for ckpt in (run_dir / "checkpoints").glob("step-*"):  # the disk loses them: only the bucket has any
        shutil.rmtree(ckpt)
    object_store.up(lambda line: None)
    assert finish(job, run_dir) == "COMPLETED"
    assert starts(run_dir)[1]["start_step"] == 2 * EVERY  # the bucket's newest complete, not the stop's
    assert [e["reason"] for e in ends(run_dir)] == ["preempted", "completed"]
    assert_losses_match(run_dir, reference["losses"])
    assert_weights_identical(run_dir, reference)
    assert bucket.complete() == [f"step-{MAX_STEPS - EVERY}", f"step-{MAX_STEPS}"]
    assert not store.client.list_multipart_uploads(Bucket=store.url.bucket).get("Uploads")
    code, out, err = lm(env, "history", name, "--json")
    notes = json.loads(out)["notes"]
    assert any(n.startswith(f"attempt 1: its last checkpoint step-{stop_at} is not in {url} (") for n in notes), notes
