"""Object storage (S3), the one owner of that outside system for both sides: the credentials a
profile names (a file of mode 600: never a command line, the plan or a log) and the boto3 client made
from them (``credentials``), and checkpoints kept in a bucket (``checkpoints``): uploaded file by file
in parallel to keys of their own, complete only once one small commit object is written last with
``If-None-Match: *``, read back verified against the checksums the commit records, and retention that
deletes old checkpoints, abandoned uploads and incomplete multipart uploads.

Belongs here: what lmlaunch asks of an S3 server. Not here: the local cluster's Ceph gateway
(launcher.localcluster.object_store starts it), where a run keeps its checkpoints (lmcore.run).

May import: the standard library, the kernel's primitives, boto3/botocore and xxhash (lazily: the CLI
imports this without paying for boto3).
"""
