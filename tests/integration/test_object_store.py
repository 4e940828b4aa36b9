"""The local cluster's object store (launcher.localcluster.object_store): `lmlaunch cluster up --s3`
starts Ceph's RADOS Gateway for real (installing Ceph's packages when missing), its keys in a file of
mode 600 and nowhere in what the command prints; S3 answers with the semantics checkpoints on object
storage build on; what it acknowledged survives every daemon SIGKILLed; `down` stops it, `up`
brings it back with its data.

One store per machine (STATE/s3), shared with its user's: the test works in a bucket of its own and
removes it. Its first `up` on a fresh machine installs and bootstraps (about 25 s here), later ones
find it running."""

from __future__ import annotations

import os
import signal
import uuid

import pytest
from botocore.exceptions import ClientError
from preempt_helpers import lm

from launcher.localcluster import object_store
from tests import gateway


@pytest.fixture
def store(lm_env, slurm_cluster):
    with gateway.alone():  # the test kills and stops the gateway: no other test may use it meanwhile
        yield from _store(lm_env)


def _store(lm_env):
    code, out, err = lm(lm_env, "cluster", "up", "--s3")
    assert code == 0, out + err
    creds = object_store.Credentials.read(object_store.store_layout().credentials)
    assert f"object store: S3 at {creds.endpoint}, bucket {creds.bucket}" in out, out
    assert creds.secret_key not in out + err and creds.access_key not in out + err
    client = object_store.s3_client(creds)
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    yield lm_env, client, bucket
    object_store.up(lambda line: None)  # running again whatever the test left
    object_store.remove_bucket(client, bucket)


def test_cluster_up_s3_gives_a_real_s3_server_whose_acknowledged_writes_survive_sigkill(store):
    env, client, bucket = store
    layout = object_store.store_layout()
    assert oct(layout.credentials.stat().st_mode & 0o777) == "0o600"

    # conditional create: exactly one writer of a key wins (a checkpoint's commit object, written last)
    client.put_object(Bucket=bucket, Key="step-10/COMPLETE", Body=b"first")
    with pytest.raises(ClientError) as refused:
        client.put_object(Bucket=bucket, Key="step-10/COMPLETE", Body=b"second", IfNoneMatch="*")
    assert refused.value.response["Error"]["Code"] == "PreconditionFailed"
    # a multipart upload is invisible until completed, then whole
    part = os.urandom(5 * 2**20)
    upload = client.create_multipart_upload(Bucket=bucket, Key="step-10/shard-0.bin")
    etags = [client.upload_part(Bucket=bucket, Key="step-10/shard-0.bin", UploadId=upload["UploadId"], PartNumber=n,
                                Body=part)["ETag"] for n in (1, 2)]
    assert [o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]] == ["step-10/COMPLETE"]
    client.complete_multipart_upload(Bucket=bucket, Key="step-10/shard-0.bin", UploadId=upload["UploadId"],
                                     MultipartUpload={"Parts": [{"ETag": e, "PartNumber": n}
                                                                for n, e in zip((1, 2), etags, strict=True)]})

    code, out, err = lm(env, "cluster", "status")
    assert "object store: S3 answering at http://127.0.0.1:7480 (3 of 3 daemons running" in out, out + err

    # every daemon killed at once (a power cut): what S3 acknowledged is there when it is back
    for name in object_store.DAEMONS:
        pid = object_store.running(layout, name)
        assert pid is not None, name
        os.kill(pid, signal.SIGKILL)
    object_store.up(lambda line: None)
    assert client.get_object(Bucket=bucket, Key="step-10/shard-0.bin")["Body"].read() == part * 2
    assert client.get_object(Bucket=bucket, Key="step-10/COMPLETE")["Body"].read() == b"first"

    # down stops it (status says so), up brings it back with its data
    object_store.down(lambda line: None)
    assert not any(object_store.status().running.values())
    code, out, err = lm(env, "cluster", "status")
    assert "object store: not answering (0 of 3 daemons running" in out, out + err
    object_store.up(lambda line: None)
    assert client.head_object(Bucket=bucket, Key="step-10/shard-0.bin")["ContentLength"] == len(part) * 2
