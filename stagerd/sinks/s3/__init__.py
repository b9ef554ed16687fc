"""The S3 backend of `FsspecSink`: s3fs's session and event loop, the aiobotocore client called directly.

backend.py is the backend, upload.py a step's uploads, client.py where stagerd meets the aiobotocore
client, latest.py `latest` written only forward, store.py what prune, leases and claims need beyond
publishing.
"""

from __future__ import annotations

from stagerd.sinks.s3.backend import S3Backend

__all__ = ["S3Backend"]
