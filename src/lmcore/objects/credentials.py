"""S3 credentials from a file a profile names, and the one way a boto3 client is made from them.

The file (JSON: ``endpoint``, ``access_key``, ``secret_key``, ``bucket``, ``region``; what ``lmlaunch
cluster up --s3`` writes for the local gateway) must be readable by its owner only: a file others can
read is refused, naming its mode. The keys never appear in a repr, a message or anything written.
"""

from __future__ import annotations

import json
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lmcore.errors import UserError

FIELDS = ("endpoint", "access_key", "secret_key", "bucket", "region")


@dataclass(frozen=True)
class Credentials:
    """What an S3 client needs: the endpoint, the keys (never in a repr), a bucket, a region."""

    endpoint: str
    access_key: str = field(repr=False)
    secret_key: str = field(repr=False)
    bucket: str = "lmlaunch"
    region: str = "default"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1) + "\n"

    @classmethod
    def read(cls, path: Path) -> Credentials:
        """The credentials in ``path``; a UserError naming the file when it is missing, readable by
        others than its owner, not JSON or without a field."""
        try:
            mode = path.stat().st_mode
        except OSError as exc:
            raise UserError(f"{path}: cannot read the S3 credentials file ({exc.strerror or exc})") from exc
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise UserError(f"{path}: the S3 credentials file has mode {stat.S_IMODE(mode):o}; it must be readable "
                            f"by its owner only (chmod 600 {path})")
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise UserError(f"{path}: not a JSON object of S3 credentials ({exc})") from exc
        missing = [k for k in FIELDS[:3] if not isinstance(raw, dict) or not raw.get(k)]
        if missing:
            raise UserError(f"{path}: the S3 credentials lack {', '.join(missing)} (fields: {', '.join(FIELDS)})")
        return cls(**{k: str(raw[k]) for k in FIELDS if raw.get(k)})


def s3_client(creds: Credentials, *, attempts: int = 3, connect_timeout: float = 5.0, read_timeout: float = 60.0) -> Any:
    """A boto3 S3 client for ``creds``: path-style addressing (one host, no bucket subdomains), a few
    retries, timeouts that let an unreachable gateway fail a save rather than hang it."""
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=creds.endpoint, aws_access_key_id=creds.access_key,
                        aws_secret_access_key=creds.secret_key, region_name=creds.region,
                        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": attempts, "mode": "standard"},
                                      connect_timeout=connect_timeout, read_timeout=read_timeout,
                                      max_pool_connections=32))
