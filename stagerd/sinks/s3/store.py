"""What prune, restore leases and claims need from S3 beyond publishing: exact listings with each object's
LastModified and ETag, the store's own clock, conditional writes and deletes, batched deletes of
named keys, and the multipart uploads pending under a deleted step, aborted each by its key and UploadId.
Every call names exact keys: a listing asks for `PREFIX/<prefix>/` with its slash and takes
only the keys under it, a delete names keys a listing returned (`DeleteObjects`, 1000 a request; a key
XML cannot carry by `DeleteObject`), and nothing here hands a path to s3fs's `rm`/`glob`/`expand_path`,
which read `*`, `?` and `[` as patterns.
"""

from __future__ import annotations

import email.utils
import logging
import re
import time
from typing import TYPE_CHECKING, Any

from stagerd.errors import SinkAuthError, SinkError
from stagerd.sinks.listed import skipped, under
from stagerd.sinks.objects import StoredObject
from stagerd.sinks.s3.client import error_code, not_implemented, precondition_failed, read_body, s3_error
from stagerd.sinks.s3.conditions import refuse

if TYPE_CHECKING:
    from stagerd.sinks.s3.backend import S3Backend

log = logging.getLogger("stagerd.sinks.s3")

DELETE_BATCH = 1000  # S3's limit per DeleteObjects


def _base(b: S3Backend, prefix: str) -> str:
    """The listing prefix of `prefix` under the sink's root, always ending in `/` (or the bucket's root)."""
    key = b.key(prefix.strip("/")) if prefix.strip("/") else b.root
    return f"{key}/" if key else ""


def objects(b: S3Backend, prefix: str, start: str = "") -> dict[str, StoredObject]:
    """Every object under `prefix/` whose relative name starts with `start` (literal: S3's `Prefix` is
    never a pattern), by relative name: size, LastModified, ETag."""

    async def go() -> dict[str, StoredObject]:
        s3 = await b._client()
        base = _base(b, prefix)
        out: dict[str, StoredObject] = {}
        outside: list[str] = []
        args = {"Bucket": b.bucket, "Prefix": base + start}
        try:
            while True:
                page = await s3.list_objects_v2(**args)
                for o in page.get("Contents", []):
                    rel = under(base, o["Key"], outside)
                    if rel is not None and not rel.startswith(start):
                        outside.append(o["Key"])
                    elif rel is not None:
                        out[rel] = StoredObject(int(o["Size"]), o["LastModified"].timestamp(), o.get("ETag"))
                if not page.get("IsTruncated"):
                    skipped(b.where(prefix), outside)
                    return out
                args["ContinuationToken"] = page["NextContinuationToken"]
        except Exception as e:
            raise s3_error(e, b.where(prefix)) from None

    result: dict[str, StoredObject] = b._run(go)
    return result


def clock(b: S3Backend) -> float:
    """The store's own time now: the `Date` of a one-key listing's answer (S3 sets it; so does moto).

    Ages of objects are judged by it against their LastModified, both the store's clock: two machines'
    clocks never meet. A store whose answers carry no Date gives this machine's time (said in a warning)."""

    async def go() -> float:
        s3 = await b._client()
        try:
            page = await s3.list_objects_v2(Bucket=b.bucket, Prefix=_base(b, ""), MaxKeys=1)
        except Exception as e:
            raise s3_error(e, b.base) from None
        date = page.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
        if date:
            return email.utils.parsedate_to_datetime(date).timestamp()
        log.warning("%s sends no Date header: object ages use this machine's clock", b.base)
        return time.time()

    now: float = b._run(go)
    return now


def read_tagged(b: S3Backend, key: str) -> tuple[bytes, str | None] | None:
    async def go() -> tuple[bytes, str | None] | None:
        s3 = await b._client()
        try:
            r = await s3.get_object(Bucket=b.bucket, Key=b.key(key))
            return await read_body(r), r.get("ETag")
        except Exception as e:
            if error_code(e)[0] in ("NoSuchKey", "404"):
                return None
            raise s3_error(e, b.where(key)) from None

    result: tuple[bytes, str | None] | None = b._run(go)
    return result


def put(b: S3Backend, key: str, data: bytes) -> None:
    b.write(key, data)


async def _exclusive(b: S3Backend, key: str) -> None:
    """Refuse a claim's change on a store that ignores any of the conditions a prune relies on: it takes a
    claim by `put_if`, and gives it back by `delete_if`, so each must hold for the claim to be its own."""
    conditions = await b.conditions(tidied=True)  # a prune is not in a hurry; a kill leaves no probe key
    if conditions.ignored():
        raise refuse(b, conditions, "a change of a claim or record", b.where(key))


def put_if(b: S3Backend, key: str, data: bytes, tag: str | None) -> str | None:
    """Write `key` only if it is absent (`tag` None) or still holds the version `tag`: the new ETag, or
    None when the condition failed. `ConditionsIgnoredError` on a store that ignores a condition a claim
    needs (`s3/conditions.py`), before anything is written."""

    async def go() -> str | None:
        await _exclusive(b, key)
        s3 = await b._client()
        cond = {"IfNoneMatch": "*"} if tag is None else {"IfMatch": tag}
        try:
            answer = await s3.put_object(Bucket=b.bucket, **b._put_args(key, data), **cond)
            return str(answer.get("ETag"))
        except Exception as e:
            if precondition_failed(e) or (tag is not None and error_code(e)[0] in ("NoSuchKey", "404")):
                return None
            if not not_implemented(e):
                raise s3_error(e, b.where(key)) from None
        log.warning("%s does not support conditional writes; read, compare, then write", b.base)
        s3 = await b._client()
        try:
            r = await s3.get_object(Bucket=b.bucket, Key=b.key(key))
            current: str | None = r.get("ETag")
            r["Body"].close()
        except Exception as e:
            if error_code(e)[0] not in ("NoSuchKey", "404"):
                raise s3_error(e, b.where(key)) from None
            current = None
        if current != tag:
            return None
        answer = await b.call(b.where(key), "put_object", **b._put_args(key, data))
        return str(answer.get("ETag"))

    result: str | None = b._run(go)
    return result


def delete_if(b: S3Backend, key: str, tag: str) -> bool:
    """Delete `key` only while it still holds the version `tag` (`If-Match`); False if it changed or went.
    `ConditionsIgnoredError` as in `put_if`."""

    async def go() -> bool:
        await _exclusive(b, key)
        s3 = await b._client()
        try:
            await s3.delete_object(Bucket=b.bucket, Key=b.key(key), IfMatch=tag)
            return True
        except Exception as e:
            if precondition_failed(e) or error_code(e)[0] in ("NoSuchKey", "404"):
                return False
            if not not_implemented(e):
                raise s3_error(e, b.where(key)) from None
        log.warning("%s does not support conditional deletes; read, compare, then delete", b.base)
        try:
            head = await s3.head_object(Bucket=b.bucket, Key=b.key(key))
        except Exception as e:
            if error_code(e)[0] in ("NoSuchKey", "404", "NotFound"):
                return False
            raise s3_error(e, b.where(key)) from None
        if head.get("ETag") != tag:
            return False
        await b.call(b.where(key), "delete_object", Key=b.key(key))
        return True

    return bool(b._run(go))


def delete(b: S3Backend, keys: list[str]) -> None:
    """Delete exactly `keys` (missing ones are fine): `DeleteObjects`, 1000 keys a request; a key that
    XML 1.0 cannot carry by its own `DeleteObject` (`_xml_safe`)."""

    async def batch(chunk: list[str]) -> None:
        s3 = await b._client()
        try:
            r: dict[str, Any] = await s3.delete_objects(
                Bucket=b.bucket, Delete={"Objects": [{"Key": b.key(k)} for k in chunk], "Quiet": True}
            )
        except Exception as e:
            raise _refused(b, s3_error(e, b.where(chunk[0]))) from None
        errors = [e for e in r.get("Errors", []) if e.get("Code") not in ("NoSuchKey",)]
        if errors:
            denied = [e for e in errors if e.get("Code") in _DENIED]
            first = (denied or errors)[0]
            kind = SinkAuthError if denied else SinkError
            raise _refused(
                b,
                kind(
                    f"{len(errors)} of {len(chunk)} deletes refused, first: {first.get('Code')} "
                    f"{first.get('Message', '')}".rstrip(),
                    path=f"s3://{b.bucket}/{first.get('Key', '')}",
                ),
            )

    async def one(key: str) -> None:
        s3 = await b._client()
        try:
            await s3.delete_object(Bucket=b.bucket, Key=b.key(key))
        except Exception as e:
            if error_code(e)[0] not in ("NoSuchKey", "404"):
                raise _refused(b, s3_error(e, b.where(key))) from None

    async def go() -> None:
        listed = [k for k in keys if _xml_safe(b.key(k))]
        for i in range(0, len(listed), DELETE_BATCH):
            await batch(listed[i : i + DELETE_BATCH])
        for key in keys:
            if not _xml_safe(b.key(key)):
                await one(key)

    if keys:
        b._run(go)


def pending_uploads(b: S3Backend, prefix: str) -> list[tuple[str, str]]:
    """(bucket key, UploadId) of each multipart upload pending under `prefix/` (`S3Backend.pending_uploads`:
    S3's literal `Prefix` with its slash, each key checked again as under it)."""

    async def go() -> list[tuple[str, str]]:
        try:
            return await b.pending_uploads(prefix)
        except Exception as e:
            raise s3_error(e, b.where(prefix)) from None

    result: list[tuple[str, str]] = b._run(go)
    return result


def abort_uploads(b: S3Backend, uploads: list[tuple[str, str]]) -> None:
    """Abort exactly these (bucket key, UploadId) pairs, as `pending_uploads` listed them."""

    async def go() -> None:
        try:
            await b.abort_uploads(uploads)
        except Exception as e:
            raise s3_error(e, b.base) from None

    if uploads:
        b._run(go)


_DENIED = {"AccessDenied", "AllAccessDisabled", "AccountProblem"}
# XML 1.0's characters, less CR: a parser reads CR (and CRLF) in text as LF, so a key with one sent in
# DeleteObjects' body would name another key (`a\nb` for `a\rb`)
_XML_TEXT = re.compile("[\t\n\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]*")


def _xml_safe(key: str) -> bool:
    """Whether `key` reaches the store unchanged in an XML body. One that is not (a control character:
    the store refuses the whole batch as malformed, and a prune stopped at that step for good; a CR: it
    would be read as another key) goes by `DeleteObject`, whose key is in the URL, percent-encoded."""
    return _XML_TEXT.fullmatch(key) is not None


def _refused(b: S3Backend, e: SinkError) -> SinkError:
    """A delete refused for want of permission names the permission: a retry cannot get it."""
    if not isinstance(e, SinkAuthError):
        return e
    where = f"{b.bucket}/{b.root}/*" if b.root else f"{b.bucket}/*"
    e.hint = (
        f"grant these credentials s3:DeleteObject on arn:aws:s3:::{where} (remote retention deletes "
        "pruned steps there), or turn remote retention (remote_keep_last/remote_keep_every) off"
    )
    return e
