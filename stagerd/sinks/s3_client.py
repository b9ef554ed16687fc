"""Where stagerd meets the aiobotocore client: its failures as named sink errors, the answers of
conditional writes, and the payload hash the client signs.

**The signed payload hash.** Over plain http (and wherever payload signing is on), SigV4 signs the sha256
of the request body: botocore hashes every PUT's body and sends the hex digest as `X-Amz-Content-SHA256`,
which the store checks against the body it receives. For a file sent in one PUT that body is the whole
file, so that digest is the file's sha256 for the manifest: taking it saves a second sha256 pass over the
file. `hook_client` registers two handlers on the client's events for this: a call made with
`PAYLOAD_SHA256=[...]` gets each attempt's header appended to that list. Over https with a checksum,
botocore sends `UNSIGNED-PAYLOAD` instead, and the uploader hashes the file itself.

**Bodies without copies.** The uploader hands botocore each part as a `bytearray`. botocore leaves a
`bytearray` as it is (a `bytes` body becomes a `BytesIO`, which SigV4 then reads back in 1 MiB copies and
aiohttp unshares with one more copy), and hashes it for SigV4 in one call. A third handler then gives
aiohttp the body as 1 MiB views of that buffer: written whole, Python 3.11's socket transport would join
it with the headers, slice the unsent rest and append that to its buffer, three copies of every part on
the event loop. With views, only what the socket does not take at once is copied.
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING, Any

from stagerd.errors import SinkAuthError, SinkError

if TYPE_CHECKING:
    from aiohttp.abc import AbstractStreamWriter
    from aiohttp.payload import Payload

PAYLOAD_SHA256 = "StagerdPayloadSha256"  # not an S3 parameter: popped before botocore validates the call
SEND_SLICE = 1 << 20  # what aiohttp is handed per write: big enough to fill the socket, small to copy
_HEX64 = re.compile(r"[0-9a-f]{64}")
_AUTH_CODES = {
    "AccessDenied",
    "AccountProblem",
    "AllAccessDisabled",
    "ExpiredToken",
    "InvalidAccessKeyId",
    "InvalidSecurity",
    "InvalidToken",
    "SignatureDoesNotMatch",
    "TokenRefreshRequired",
}


def hook_client(s3: Any) -> None:
    """Register the payload-hash handlers on `s3` (idempotent: botocore keeps one per unique id)."""
    events = s3.meta.events
    events.register("before-parameter-build.s3", _take_payload_list, unique_id="stagerd-payload-list")
    events.register("before-send.s3", _record_payload_sha256, unique_id="stagerd-payload-sha256")
    events.register("before-send.s3", _send_in_slices, unique_id="stagerd-send-in-slices")


def _take_payload_list(params: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
    sink = params.pop(PAYLOAD_SHA256, None)
    if sink is not None:
        context[PAYLOAD_SHA256] = sink


def _record_payload_sha256(request: Any, **_: Any) -> None:
    sink = (getattr(request, "context", None) or {}).get(PAYLOAD_SHA256)
    if sink is not None:
        value = request.headers.get("X-Amz-Content-SHA256")
        sink.append(value.decode() if isinstance(value, bytes) else value)


def _send_in_slices(request: Any, **_: Any) -> None:
    body = request.body
    if isinstance(body, bytearray) and len(body) > SEND_SLICE:
        request.body = _buffer_payload_type()(body)


@functools.cache
def _buffer_payload_type() -> type[Payload]:
    """An aiohttp payload that writes a buffer in `SEND_SLICE` views (aiohttp is imported on first use)."""
    from aiohttp.payload import Payload

    class BufferSlices(Payload):
        def __init__(self, value: bytearray) -> None:
            super().__init__(value, content_type="application/octet-stream")
            self._size = len(value)

        def seek(self, offset: int, whence: int = 0) -> int:
            """botocore rewinds a body before it retries; every write starts at the buffer's start."""
            return 0

        def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
            return bytes(self._value).decode(encoding, errors)

        async def as_bytes(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
            return bytes(self._value)

        async def write(self, writer: AbstractStreamWriter) -> None:
            await self.write_with_length(writer, None)

        async def write_with_length(self, writer: AbstractStreamWriter, content_length: int | None) -> None:
            view = memoryview(self._value)
            end = len(view) if content_length is None else min(content_length, len(view))
            for start in range(0, end, SEND_SLICE):
                await writer.write(view[start : min(end, start + SEND_SLICE)])

    return BufferSlices


def signed_sha256(sent: list[Any]) -> str | None:
    """The sha256 hex the last attempt signed as its payload hash, or None (unsigned, streaming, absent)."""
    last = sent[-1] if sent else None
    return last if isinstance(last, str) and _HEX64.fullmatch(last) else None


def signs_payload(s3: Any) -> bool:
    """Whether this client signs the sha256 of request bodies that carry a checksum, as botocore decides:
    the `payload_signing_enabled` setting if there is one, else over http always, over https never."""
    setting = (getattr(s3.meta.config, "s3", None) or {}).get("payload_signing_enabled")
    if setting is not None:
        return bool(setting)
    return not str(s3.meta.endpoint_url).startswith("https:")


def error_code(e: BaseException) -> tuple[str | None, int | None]:
    """The S3 error code and HTTP status of a botocore error, if it is one."""
    r = getattr(e, "response", None) or {}
    return r.get("Error", {}).get("Code"), r.get("ResponseMetadata", {}).get("HTTPStatusCode")


def precondition_failed(e: BaseException) -> bool:
    """A conditional write refused: the key is taken (`If-None-Match`) or changed (`If-Match`); a 409 is
    S3's answer to a conditional write racing another on the same key."""
    code, status = error_code(e)
    return status == 412 or code in ("PreconditionFailed", "ConditionalRequestConflict")


def not_implemented(e: BaseException) -> bool:
    """A store that has no conditional writes."""
    code, status = error_code(e)
    return status == 501 or code == "NotImplemented"


def s3_error(e: BaseException, where: str) -> SinkError:
    """A botocore/aiohttp failure as a named sink error: auth problems are not retryable, the rest are.

    Only the S3 error code and message go into the text: never a header, a signature or a credential.
    """
    from botocore.exceptions import (
        ClientError,
        CredentialRetrievalError,
        NoCredentialsError,
        PartialCredentialsError,
    )

    if isinstance(e, SinkError):
        return e
    if isinstance(e, ClientError):
        err = e.response.get("Error", {})
        code = str(err.get("Code", "Unknown"))
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        msg = f"{code} (HTTP {status}) from {e.operation_name}: {err.get('Message', '')}".rstrip(": ")
        if code in _AUTH_CODES or status == 403:
            return SinkAuthError(msg, path=where)
        if code == "NoSuchBucket":
            return SinkError(msg, path=where, hint="create the bucket, or fix the sink URL")
        return SinkError(f"{msg} (after the client's retries)", path=where)
    if isinstance(e, NoCredentialsError | PartialCredentialsError | CredentialRetrievalError):
        return SinkAuthError(f"{type(e).__name__}: {e}", path=where)
    return SinkError(f"{type(e).__name__}: {e} (after the client's retries)", path=where)
