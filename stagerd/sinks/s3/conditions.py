"""Whether an S3 store honours the conditional requests claims rely on, found once per backend by a probe.

Some S3-compatible stores answer `PutObject` with `If-None-Match: *` or `If-Match`, and `DeleteObject` with
`If-Match`, as if the header were absent: 2xx, the key overwritten or deleted. Others answer 501 (their
answer is handled where each request is made). On a store that ignores a condition, a request that relies
on it would change a key another writer may hold, so:

- a publisher sends no create-only PUTs before its listing (each would overwrite a published file), and
  creates its claim and manifest by exists-then-put, as on a store that answers 501 (`S3Backend._create`);
- a losing publisher leaves what it created early in another publisher's step, and logs those keys
  (`S3Backend.discard`);
- a prune refuses (`ConditionsIgnoredError`) before it changes anything: its claim would not be exclusive.

**The probe**, before the backend's first conditional request: a scratch key under the sink's own root
(`.stagerd-probe-<random>`), written plainly; then, together, a PUT of it with `If-None-Match: *` and one
with `If-Match` on an ETag it cannot have; then a DELETE with that `If-Match`; then its plain DELETE if that
one was refused. Each conditional request must be refused (412) by a store that honours it. Five requests
in four round trips (one fewer where the DELETE was done), all on that one exact key. (RustFS, for one,
parses `If-Match` on DELETE and ignores it.) A kill mid-probe leaves that tiny object, which no listing
of steps, claims or records reads.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from stagerd.errors import SinkError
from stagerd.sinks.s3.client import not_implemented, precondition_failed, s3_error

log = logging.getLogger("stagerd.sinks.s3")

PROBE_PREFIX = ".stagerd-probe-"
_NO_SUCH_ETAG = '"00000000000000000000000000000000"'  # no body's MD5 we write: If-Match on it must fail
_NAMES = {"create": "If-None-Match on PUT", "replace": "If-Match on PUT", "delete": "If-Match on DELETE"}
HINT = (
    "use a store that honours If-None-Match and If-Match on PUT and If-Match on DELETE (AWS S3 does); until "
    "then delete old steps by hand, manifest first, while nothing publishes to or prunes the sink"
)


class S3Backend(Protocol):
    """What the probe uses of `s3/backend.S3Backend` (which imports this module)."""

    bucket: str
    base: str

    async def _client(self) -> Any: ...
    async def call(self, where: str, method: str, **kwargs: Any) -> Any: ...
    def key(self, key: str) -> str: ...
    def where(self, key: str) -> str: ...


class Support(enum.Enum):
    HONOURED = "honoured"  # refused when the condition fails (412)
    IGNORED = "ignored"  # done as if the header were absent
    NOT_IMPLEMENTED = "not implemented"  # 501: the request is refused, nothing changed


@dataclass(frozen=True)
class Conditions:
    """What the store does with each conditional request stagerd makes."""

    create: Support  # PutObject, If-None-Match: *
    replace: Support  # PutObject, If-Match
    delete: Support  # DeleteObject, If-Match

    def ignored(self) -> list[str]:
        return [_NAMES[k] for k, v in vars(self).items() if v is Support.IGNORED]


class ConditionsIgnoredError(SinkError):
    """The store ignores a conditional request that makes a change exclusive: nothing was changed."""

    retryable = False
    hint = HINT


def refuse(b: S3Backend, conditions: Conditions, what: str, where: str) -> ConditionsIgnoredError:
    return ConditionsIgnoredError(
        f"{b.base} ignores {' and '.join(conditions.ignored())}: {what} would not be exclusive; nothing "
        "was changed",
        path=where,
    )


def leave(b: S3Backend, keys: list[str], support: Support) -> None:
    """A loser's cleanup on a store without `If-Match` on DELETE: nothing deleted, every key named once."""
    if keys:
        log.warning(
            "%s: If-Match on DELETE is %s, so %d object(s) this publish created in a step another publisher "
            "holds stay: %s (delete them by hand once that step's manifest is there and does not name them)",
            b.base,
            support.value,
            len(keys),
            ", ".join(b.where(k) for k in keys),
        )


async def probe(b: S3Backend) -> Conditions:
    """Find the store's `Conditions` (module docstring)."""
    s3 = await b._client()
    key = b.key(f"{PROBE_PREFIX}{uuid.uuid4().hex}")
    where = f"s3://{b.bucket}/{key}"
    body = {"Key": key, "Body": b"stagerd probe\n"}

    async def answer(method: str, **kwargs: Any) -> Support:
        try:
            await getattr(s3, method)(Bucket=b.bucket, **kwargs)
            return Support.IGNORED
        except Exception as e:
            if precondition_failed(e):
                return Support.HONOURED
            if not_implemented(e):
                return Support.NOT_IMPLEMENTED
            raise s3_error(e, where) from None

    try:
        await s3.put_object(Bucket=b.bucket, **body)
    except Exception as e:
        raise s3_error(e, where) from None
    create, replace = await asyncio.gather(
        answer("put_object", **body, IfNoneMatch="*"), answer("put_object", **body, IfMatch=_NO_SUCH_ETAG)
    )
    delete = await answer("delete_object", Key=key, IfMatch=_NO_SUCH_ETAG)
    if delete is not Support.IGNORED:  # still there: our own scratch key, by its exact name
        await b.call(where, "delete_object", Key=key)
    found = Conditions(create, replace, delete)
    if found.ignored():
        then = ["prunes are refused"]
        if create is Support.IGNORED:
            then.insert(0, "no PUT before a step's listing, claims and manifests are exists-then-put")
        if delete is Support.IGNORED:
            then.insert(0, "a losing publisher leaves what it created")
        log.warning("%s ignores %s: %s", b.base, ", ".join(found.ignored()), "; ".join(then))
    return found
