"""Checkpoints in an S3 bucket: ``s3://BUCKET/PREFIX``, one checkpoint per name (``step-N``).

Layout under the prefix::

    step-40/<token>/<file>...   the checkpoint's files, uploaded by one attempt (a token of its own)
    step-40/<token>/.rank-R.json  a rank's own files of a sharded checkpoint, uploaded by that rank
                                (:meth:`CheckpointStore.publish`) for the checkpoint's upload to reuse
    step-40.commit              JSON: the token, every file's key, size and xxh3_128 checksum

An upload writes every file under a fresh token (large files in parallel multipart uploads: Ceph's
gateway ignores ``If-None-Match`` on CompleteMultipartUpload, so no two writers ever complete the
same key), then the commit object last, with ``If-None-Match: *``: the checkpoint is complete when,
and only when, its commit exists, and exactly one upload of a name wins. A reader lists commits,
reads only the files a commit names and verifies each against its checksum. Retention keeps the
newest ``keep_last`` complete checkpoints and deletes the rest, the files of uploads that lost or
were abandoned, and incomplete multipart uploads; an upload newer than the newest complete
checkpoint may still be under way and is left alone.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmcore.digests import file_digest
from lmcore.errors import UserError

COMMIT_SUFFIX = ".commit"
MARKER_PREFIX = ".rank-"  # a rank's published files: NAME/TOKEN/.rank-R.json
PART = 64 << 20  # multipart threshold and part size
_URL = re.compile(r"^s3://(?P<bucket>[a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(?:/(?P<prefix>.*?))?/?$")


class ObjectStoreError(RuntimeError):
    """The store refused, could not be reached, or holds something that does not verify."""


@dataclass(frozen=True)
class S3Url:
    bucket: str
    prefix: str  # no leading or trailing slash; "" for the bucket's root

    @classmethod
    def parse(cls, url: str) -> S3Url:
        m = _URL.match(url.strip())
        if not m or "//" in (m.group("prefix") or ""):
            raise UserError(f"{url!r}: not an S3 location; write s3://BUCKET/PREFIX (a bucket of 3-63 lowercase "
                            "letters, digits, dots and dashes; a prefix without empty parts)")
        return cls(m.group("bucket"), (m.group("prefix") or "").strip("/"))

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


@dataclass(frozen=True)
class Commit:
    name: str
    token: str
    files: dict[str, dict[str, Any]]  # relative path -> {"key", "bytes", "xxh3_128"}

    @property
    def bytes(self) -> int:
        return sum(int(f["bytes"]) for f in self.files.values())

    def tokens(self, base: str) -> set[str]:
        """The uploads its files are in (its own, and the ranks' that published theirs); ``base``: the
        checkpoint's key prefix (``PREFIX/NAME``)."""
        return {self.token} | {str(f["key"])[len(base) + 1:].split("/")[0] for f in self.files.values()}


@dataclass(frozen=True)
class Removed:
    checkpoints: tuple[str, ...]  # complete ones past keep_last
    objects: int  # every object deleted (theirs, and abandoned uploads' files)
    multipart: int  # incomplete multipart uploads aborted


def step_of(name: str) -> int:
    m = re.search(r"(\d+)$", name)
    return int(m.group(1)) if m else -1


def _new_token() -> str:
    """An upload's own key component: time first, so that listings order uploads by age."""
    return f"{int(time.time())}-{secrets.token_hex(6)}"


def _open_either(path: Path, other: Path | None) -> int:
    try:
        return os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        if other is None:
            raise
        return os.open(other, os.O_RDONLY)


def _error_code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    return str((response or {}).get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""


class CheckpointStore:
    """The checkpoints under one S3 location, through one boto3 client (lmcore.objects.credentials)."""

    def __init__(self, client: Any, url: S3Url, *, workers: int = 8) -> None:
        self.client, self.url, self.workers = client, url, workers

    @classmethod
    def at(cls, url: str, credentials: str | Path) -> CheckpointStore:
        """The store at ``url`` (``s3://...``) with the credentials file ``credentials`` (a plan's
        paths.checkpoint_store and paths.checkpoint_store_credentials)."""
        from lmcore.objects.credentials import Credentials, s3_client

        return cls(s3_client(Credentials.read(Path(credentials))), S3Url.parse(url))

    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.url.prefix, *parts) if p)

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        from boto3.exceptions import Boto3Error
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn()
        except (BotoCoreError, ClientError, Boto3Error) as exc:  # Boto3Error: upload_file's S3UploadFailedError
            raise ObjectStoreError(f"{self.url}: {what}: {exc}") from exc

    def _transfer_config(self) -> Any:
        from boto3.s3.transfer import TransferConfig

        return TransferConfig(multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=self.workers)

    # --- writing ------------------------------------------------------------------------------------
    def upload(self, local: Path, name: str, *, digests: Mapping[str, str] | None = None,
               reuse: Mapping[str, Mapping[str, Any]] | None = None) -> Commit:
        """Every file under ``local`` to keys of a fresh token, in parallel, then the commit. If another
        upload of ``name`` committed first, its commit stands and this one's files are deleted.
        ``digests``: files' checksums already known (a checkpoint's manifest), by relative path; the
        others are read to compute theirs. ``reuse``: files the ranks that wrote them already uploaded
        (:meth:`published`), taken as they are when their size and checksum are the file's."""
        files = sorted(p for p in local.rglob("*") if p.is_file())
        if not files:
            raise ObjectStoreError(f"{local}: no files to upload as {name}")
        token = _new_token()
        config = self._transfer_config()

        def one(path: Path) -> tuple[str, dict[str, Any]]:
            rel = path.relative_to(local).as_posix()
            key = self._key(name, token, rel)
            size, digest = path.stat().st_size, (digests or {}).get(rel) or file_digest(path)
            there = (reuse or {}).get(rel)
            if there and int(there["bytes"]) == size and there["xxh3_128"] == digest:
                return rel, {"key": str(there["key"]), "bytes": size, "xxh3_128": digest}
            self._call(f"upload of {rel}", lambda: self.client.upload_file(str(path), self.url.bucket, key, Config=config))
            return rel, {"key": key, "bytes": size, "xxh3_128": digest}

        with ThreadPoolExecutor(max_workers=min(self.workers, len(files))) as pool:
            entries = dict(pool.map(one, files))
        commit = Commit(name, token, entries)
        body = json.dumps({"format": 1, "name": name, "token": token, "files": entries, "time": time.time()})
        from botocore.exceptions import ClientError

        try:
            self._call(f"commit of {name}", lambda: self.client.put_object(
                Bucket=self.url.bucket, Key=self._key(name + COMMIT_SUFFIX), Body=body.encode(), IfNoneMatch="*"))
        except ObjectStoreError as exc:
            if not isinstance(exc.__cause__, ClientError) or _error_code(exc.__cause__) not in ("PreconditionFailed", "412"):
                raise
            self._delete(self._keys(self._key(name, token) + "/"))  # the other upload's commit stands
            return self.commit(name)
        return commit

    def publish(self, local: Path, name: str, files: Mapping[str, tuple[int, str]], rank: int, *,
                renamed_to: Path | None = None) -> dict[str, dict[str, Any]]:
        """Rank ``rank``'s own files of the checkpoint ``name`` being written under ``local`` (``rel ->
        (bytes, xxh3)``), uploaded to keys of a fresh token, then the marker ``NAME/TOKEN/.rank-R.json``
        that lists them: the checkpoint's upload reuses them (:meth:`published`). Their entries. Each
        file is opened first (under ``renamed_to`` when ``local`` was renamed meanwhile, as a complete
        checkpoint's directory is) and read through its descriptor: a rename during the upload is harmless."""
        token, config = _new_token(), self._transfer_config()

        def one(item: tuple[str, tuple[int, str]]) -> tuple[str, dict[str, Any]]:
            rel, (size, digest) = item
            key = self._key(name, token, rel)
            fd = _open_either(local / rel, renamed_to / rel if renamed_to else None)
            try:
                self._call(f"upload of {rel}", lambda: self.client.upload_file(f"/proc/self/fd/{fd}", self.url.bucket, key,
                                                                               Config=config))
            finally:
                os.close(fd)
            return rel, {"key": key, "bytes": size, "xxh3_128": digest}

        with ThreadPoolExecutor(max_workers=max(1, min(self.workers, len(files)))) as pool:
            entries = dict(pool.map(one, sorted(files.items())))
        body = json.dumps({"rank": rank, "files": entries}).encode()
        self._call(f"marker of rank {rank}", lambda: self.client.put_object(
            Bucket=self.url.bucket, Key=self._key(name, token, f"{MARKER_PREFIX}{rank}.json"), Body=body))
        return entries

    def published(self, name: str) -> dict[int, dict[str, dict[str, Any]]]:
        """The files ranks published for the checkpoint ``name`` (:meth:`publish`), by rank; a marker
        that cannot be read is left out (its files are then uploaded by the checkpoint's upload)."""
        out: dict[int, dict[str, dict[str, Any]]] = {}
        for key in self._keys(self._key(name) + "/"):
            if not key.rsplit("/", 1)[-1].startswith(MARKER_PREFIX):
                continue
            try:
                doc = json.loads(self._read(key, "read of a marker"))
                out.setdefault(int(doc["rank"]), {}).update(doc["files"])
            except (ObjectStoreError, ValueError, KeyError, TypeError):
                continue
        return out

    # --- reading ------------------------------------------------------------------------------------
    def _keys(self, prefix: str, delimiter: str | None = None) -> Iterator[str]:
        kwargs: dict[str, Any] = {"Bucket": self.url.bucket, "Prefix": prefix}
        if delimiter:
            kwargs["Delimiter"] = delimiter
        pages = self._call("list", lambda: list(self.client.get_paginator("list_objects_v2").paginate(**kwargs)))
        for page in pages:
            for obj in page.get("Contents", []):
                yield obj["Key"]

    def complete(self) -> list[str]:
        """The complete checkpoints' names, oldest step first."""
        base = self._key() + "/" if self.url.prefix else ""
        names = [k[len(base):-len(COMMIT_SUFFIX)] for k in self._keys(base, "/") if k.endswith(COMMIT_SUFFIX)]
        return sorted(names, key=lambda n: (step_of(n), n))

    def _read(self, key: str, what: str) -> bytes:
        body: bytes = self._call(what, lambda: self.client.get_object(Bucket=self.url.bucket, Key=key)["Body"].read())
        return body

    def commit(self, name: str) -> Commit:
        raw = self._call(f"read of {name}'s commit", lambda: self.client.get_object(
            Bucket=self.url.bucket, Key=self._key(name + COMMIT_SUFFIX))["Body"].read())
        try:
            doc = json.loads(raw)
            return Commit(doc["name"], doc["token"], dict(doc["files"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise ObjectStoreError(f"{self.url}/{name}{COMMIT_SUFFIX}: not a checkpoint commit ({exc})") from exc

    def download(self, name: str, dest: Path) -> Commit:
        """The complete checkpoint ``name`` into ``dest`` (made; files already there are replaced), every
        file verified against its commit's checksum before it takes its name."""
        commit = self.commit(name)
        config = self._transfer_config()

        def one(item: tuple[str, dict[str, Any]]) -> None:
            rel, entry = item
            path = dest / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            part = path.with_name(path.name + ".part")
            self._call(f"download of {rel}", lambda: self.client.download_file(
                self.url.bucket, entry["key"], str(part), Config=config))
            size, digest = part.stat().st_size, file_digest(part)
            if size != int(entry["bytes"]) or digest != entry["xxh3_128"]:
                part.unlink(missing_ok=True)
                raise ObjectStoreError(f"{self.url}/{entry['key'].removeprefix(self._key() + '/')}: {size} bytes, "
                                       f"xxh3 {digest}; its commit says {entry['bytes']} bytes, xxh3 {entry['xxh3_128']}")
            os.replace(part, path)

        dest.mkdir(parents=True, exist_ok=True)
        with ThreadPoolExecutor(max_workers=max(1, min(self.workers, len(commit.files)))) as pool:
            list(pool.map(one, sorted(commit.files.items())))
        return commit

    # --- retention ------------------------------------------------------------------------------------
    def _delete(self, keys: Iterator[str] | list[str]) -> int:
        batch: list[dict[str, str]] = []
        n = 0
        for key in keys:
            batch.append({"Key": key})
            if len(batch) == 1000:
                n += self._delete_batch(batch)
                batch = []
        return n + (self._delete_batch(batch) if batch else 0)

    def _delete_batch(self, batch: list[dict[str, str]]) -> int:
        self._call("delete", lambda: self.client.delete_objects(Bucket=self.url.bucket, Delete={"Objects": batch, "Quiet": True}))
        return len(batch)

    def _stale(self, name: str, token: str, kept: dict[str, set[str]], newest: int) -> bool:
        """Whether an upload's files (``name``/``token``) belong to no kept checkpoint and cannot still be
        under way: a kept name's uploads its commit does not name, and any name at or before the newest
        complete step."""
        if name in kept:
            return token not in kept[name]
        return step_of(name) <= newest

    def retain(self, keep_last: int) -> Removed:
        names = self.complete()
        drop = names[:-keep_last] if keep_last > 0 else names
        for name in drop:  # no longer complete first, then its files
            self._delete([self._key(name + COMMIT_SUFFIX)])
        kept = {n: self.commit(n).tokens(self._key(n)) for n in names if n not in drop}
        newest = max((step_of(n) for n in names), default=-1)
        base = self._key() + "/" if self.url.prefix else ""

        def parts(key: str) -> tuple[str, str] | None:
            rest = key[len(base):].split("/")
            return (rest[0], rest[1]) if len(rest) >= 3 else None

        stale = [k for k in self._keys(base) if (p := parts(k)) and self._stale(*p, kept, newest)]
        objects = self._delete(stale)
        uploads = self._call("list of multipart uploads", lambda: list(
            self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.url.bucket, Prefix=base)))
        stale_uploads = [up for page in uploads for up in page.get("Uploads", [])
                         if (p := parts(up["Key"])) and self._stale(*p, kept, newest)]
        for up in stale_uploads:
            self._abort(up["Key"], up["UploadId"])
        return Removed(tuple(drop), objects, len(stale_uploads))

    def _abort(self, key: str, upload_id: str) -> None:
        self._call("abort of a multipart upload", lambda: self.client.abort_multipart_upload(
            Bucket=self.url.bucket, Key=key, UploadId=upload_id))
