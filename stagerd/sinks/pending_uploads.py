"""The multipart uploads left pending under a step that remote retention deletes (`prune.delete_step`).

S3 bills a pending upload's parts until it is aborted, and no listing of objects shows it: a writer killed
mid-upload (a publisher, a fleet node, before claims an older stagerd) leaves one. A publish's restart and
the fleet leader's commit sweep their step, but a step retention or a prune deletes may still hold one,
and once its files are gone nothing would ever look there again. So the prune aborts those under exactly
the step's prefix (`PREFIX/step-N/`, `raw/step-N/`, `fleet/step-N/`, with the slash: never `step-N0/`),
each by its listed key and UploadId, while it still holds the step's claims: no publisher of the step is
writing then, and a new one starts its uploads only after the claims are given back.

Best effort, as the sweeps: credentials without s3:ListBucketMultipartUploads (or AbortMultipartUpload)
leave them to the bucket's `AbortIncompleteMultipartUpload` lifecycle rule, with a warning; the step's
deletion stands. Other stores have no multipart uploads.
"""

from __future__ import annotations

import logging

from stagerd.errors import SinkError
from stagerd.sinks.remote import RemoteStore

log = logging.getLogger("stagerd.sinks.prune")


def abort_pending(store: RemoteStore, prefixes: list[str], *, dry_run: bool = False) -> int | None:
    """Abort the multipart uploads pending under each of `prefixes` (`dry_run`: only count them): how
    many, or None where the store would not list or abort them (warned)."""
    if store.s3 is None:
        return 0
    from stagerd.sinks.s3 import store as s3_store

    count = 0
    for prefix in prefixes:
        try:
            uploads = s3_store.pending_uploads(store.s3, prefix)
            if not dry_run:
                s3_store.abort_uploads(store.s3, uploads)
        except SinkError as e:
            log.warning(
                "cannot abort the multipart uploads pending under %s/: %s (a bucket lifecycle rule "
                "AbortIncompleteMultipartUpload removes them)",
                store.where(prefix),
                e.message,
            )
            return None
        count += len(uploads)
        if uploads and not dry_run:
            log.info("aborted %d pending multipart upload(s) under %s/", len(uploads), store.where(prefix))
    return count
