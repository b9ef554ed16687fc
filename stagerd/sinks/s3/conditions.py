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

**The probe**, before the backend's first conditional request: two scratch keys under the sink's own root
(`.stagerd-probe-HOST-PID-<random>-put` and `-delete`), written plainly; then, together, a PUT of the first
with `If-None-Match: *`, one with `If-Match` on an ETag it cannot have, and a DELETE of the second with that
`If-Match`: a store that honours a condition refuses its request (412). Seven requests (six where the DELETE
was done), all on those two exact keys, in two round trips before the answer: the scratch keys' plain
DELETEs go out beside the step's first requests, and the step's opening waits for them (a prune's first
change, before it). A kill mid-probe leaves those tiny objects, which no listing of steps, claims or records
reads; the next probe's tidy-up lists the scratch keys (an eighth request, beside the step's first ones) and
deletes a dead probe's: one of this host and pid namespace whose pid is gone (the names say `HOST-PID`,
HOST as `temp_names.py` says it: the next container of a pod is another host here), or any older than
`PROBE_STALE_S` by the store's clock (its own key's LastModified), so kills never make them pile up.
(RustFS, for one, parses `If-Match` on DELETE and ignores it.)
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import re
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from stagerd.errors import ConditionsIgnoredError, SinkError, SinkMissingError
from stagerd.ops.crashpoints import crash_point
from stagerd.ops.processes import pid_alive
from stagerd.sinks.s3.client import error_code, not_implemented, precondition_failed, s3_error
from stagerd.sinks.temp_names import HOST

log = logging.getLogger("stagerd.sinks.s3")

PROBE_PREFIX = ".stagerd-probe-"
# A probe's keys live for two round trips; one this much older than a fresh probe's is a killed one's.
PROBE_STALE_S = 3600.0
# `HOST-PID-` since the names say whose: an older stagerd's name has no host, judged by age alone
_PROBE_KEY = re.compile(
    re.escape(PROBE_PREFIX) + r"(?:(?P<host>[A-Za-z0-9._]+)-(?P<pid>\d+)-)?[0-9a-f]{32}-(?:put|delete)"
)
_NO_SUCH_ETAG = '"00000000000000000000000000000000"'  # no body's MD5 we write: If-Match on it must fail
_NAMES = {"create": "If-None-Match on PUT", "replace": "If-Match on PUT", "delete": "If-Match on DELETE"}


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
    NOT_IMPLEMENTED = "not implemented"  # 501 (or 400/405, a header refused): the request is refused
    DENIED = "denied"  # 403: this user may not (an append-only policy without DeleteObject), nothing changed


@dataclass(frozen=True)
class Conditions:
    """What the store does with each conditional request stagerd makes."""

    create: Support  # PutObject, If-None-Match: *
    replace: Support  # PutObject, If-Match
    delete: Support  # DeleteObject, If-Match

    def ignored(self) -> list[str]:
        return [_NAMES[k] for k, v in vars(self).items() if v is Support.IGNORED]


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


async def probe(b: S3Backend) -> tuple[Conditions, asyncio.Future[None]]:
    """Find the store's `Conditions` (module docstring), and the deletion of the scratch keys, still going
    on: it need not hold up the step's first requests."""
    s3 = await b._client()
    name = f"{PROBE_PREFIX}{HOST}-{os.getpid()}-{uuid.uuid4().hex}"
    put, delete = b.key(f"{name}-put"), b.key(f"{name}-delete")
    body = b"stagerd probe\n"

    def failed(e: Exception) -> SinkError:
        """The sink named, not a scratch key the user never chose; the key only as the message's detail."""
        err = s3_error(e, b.base)
        if isinstance(err, SinkMissingError):  # the bucket, not the key, is what is wrong
            return err
        detail = f"{err.message} (probing its conditional requests on the scratch key {name}-put)"
        return type(err)(detail, path=b.base, hint=err.hint)

    async def answer(method: str, **kwargs: Any) -> Support:
        try:
            await getattr(s3, method)(Bucket=b.bucket, **kwargs)
            return Support.IGNORED
        except Exception as e:
            if precondition_failed(e):
                return Support.HONOURED
            code, status = error_code(e)
            if not_implemented(e) or status in (400, 405):  # a header it refuses: nothing changed
                return Support.NOT_IMPLEMENTED
            if status == 403 or code == "AccessDenied":  # publishing needs no delete: it goes on
                return Support.DENIED
            raise failed(e) from None

    async def settled(*requests: Any) -> list[Any]:
        """Every request's answer; a failure is raised once all are done, so none is left in flight."""
        done = await asyncio.gather(*requests, return_exceptions=True)
        first = next((d for d in done if isinstance(d, BaseException)), None)
        if first is not None:
            raise failed(first) if isinstance(first, Exception) else first
        return done

    await settled(*(s3.put_object(Bucket=b.bucket, Key=k, Body=body) for k in (put, delete)))
    crash_point("s3.probe")
    try:
        create, replace, removal = await settled(
            answer("put_object", Key=put, Body=body, IfNoneMatch="*"),
            answer("put_object", Key=put, Body=body, IfMatch=_NO_SUCH_ETAG),
            answer("delete_object", Key=delete, IfMatch=_NO_SUCH_ETAG),
        )
    except Exception:
        await _tidy(b, [put, delete], put)  # a store failing now and then must not gather two keys a retry
        raise
    left = [put] if removal is Support.IGNORED else [put, delete]  # our own scratch keys, exact names
    found = Conditions(create, replace, removal)
    if found.ignored():
        then = ["prunes are refused"]
        if create is Support.IGNORED:
            then.insert(0, "no PUT before a step's listing, claims and manifests are exists-then-put")
        if removal is Support.IGNORED:
            then.insert(0, "a losing publisher leaves what it created")
        log.warning("%s ignores %s: %s", b.base, ", ".join(found.ignored()), "; ".join(then))
    return found, asyncio.ensure_future(_tidy(b, left, put))


async def _tidy(b: S3Backend, keys: list[str], own: str) -> None:
    """Best effort: a key left is a few bytes that nothing lists. With ours go a dead probe's (docstring)."""
    s3 = await b._client()
    try:
        keys = keys + await _dead_probes(b, s3, own)
    except Exception as e:
        log.warning("left old probes' scratch keys beside s3://%s/%s: %s", b.bucket, own, s3_error(e, ""))
    gone = (s3.delete_object(Bucket=b.bucket, Key=k) for k in keys)
    for key, done in zip(keys, await asyncio.gather(*gone, return_exceptions=True), strict=True):
        if isinstance(done, Exception):
            log.warning("left the probe's scratch key s3://%s/%s: %s", b.bucket, key, s3_error(done, ""))


async def _dead_probes(b: S3Backend, s3: Any, own: str) -> list[str]:
    """The scratch keys of probes that will never delete them: this host's dead pids', and the stale."""
    prefix = b.key(PROBE_PREFIX)
    page = await s3.list_objects_v2(Bucket=b.bucket, Prefix=prefix)
    found = {o["Key"]: o["LastModified"] for o in page.get("Contents", [])}
    now = found.get(own)
    dead = []
    for key, when in found.items():
        m = _PROBE_KEY.fullmatch(key[len(prefix) - len(PROBE_PREFIX) :])
        if key == own or m is None or not key.startswith(prefix):  # a store that ignores `Prefix`: not ours
            continue
        killed_here = m["host"] == HOST and not pid_alive(int(m["pid"]))
        if killed_here or (now is not None and (now - when).total_seconds() > PROBE_STALE_S):
            dead.append(key)
    return dead
