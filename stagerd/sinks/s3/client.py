"""Where stagerd meets the aiobotocore client: its failures as named sink errors, the answers of
conditional writes, the payload hash it signs, how bodies reach aiohttp, and how an answer's body is read
(`read_body`).

**The signed payload hash, computed by the uploader.** Over plain http (and wherever payload signing is
on), SigV4 signs the sha256 of the request body as `X-Amz-Content-SHA256`, which the store checks against
the body it receives. botocore would hash every body for it on the event loop, where 16 MiB of sha256
holds up every other request in flight. The uploader hashes each body in a worker thread instead, as it
reads it, and passes the hex digest with the call (`BODY_SHA256=`, not an S3 parameter). `hook_client`
registers what takes it from there: the parameter moves into the request's context, and a signer that
is botocore's S3 SigV4 except that it signs the digest it is handed. The store still checks the body
against it, so a wrong digest fails the request (`XAmzContentSHA256Mismatch`). For a file sent in one
PUT, that digest is the file's sha256 for the manifest: one pass over the file, not two. Over https with
a checksum botocore signs `UNSIGNED-PAYLOAD`: the uploader then computes no part digests.

**Bodies without copies.** The uploader hands botocore each body as a `bytearray`. botocore leaves a
`bytearray` as it is (a `bytes` body becomes a `BytesIO`, which aiohttp unshares with one more copy). A
third handler then gives aiohttp a big body as 1 MiB views of that buffer: written whole, Python 3.11's
socket transport would join it with the headers, slice the unsent rest and append that to its buffer,
three copies of every part on the event loop. With views, only what the socket does not take at once is
copied.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from stagerd.errors import SinkAuthError, SinkError, SinkMissingError
from stagerd.sinks.denied import s3_denied_hint

if TYPE_CHECKING:
    from aiohttp.abc import AbstractStreamWriter
    from aiohttp.payload import Payload

BODY_SHA256 = "StagerdBodySha256"  # not an S3 parameter: popped before botocore validates the call
_SIGNER = "s3v4-stagerd"  # botocore's S3 SigV4, signing a payload digest computed beforehand
SEND_SLICE = 1 << 20  # what aiohttp is handed per write: big enough to fill the socket, small to copy
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
    """Register the handlers above on `s3` (idempotent: botocore keeps one per unique id)."""
    _register_signer()
    events = s3.meta.events
    events.register("before-parameter-build.s3", _take_body_sha256, unique_id="stagerd-body-sha256")
    events.register("choose-signer.s3", _choose_known_digest_signer, unique_id="stagerd-signer")
    events.register("before-send.s3", _send_in_slices, unique_id="stagerd-send-in-slices")


async def build_lazy_parts(s3: Any) -> None:
    """Make now, with the client, what aiobotocore and botocore make on its first use, where a step's
    first request, and every request behind it, would wait for them:
    - the aiohttp session, whose TLS context loads the CA bundle (in a thread, even for an http
      endpoint): 30-45 ms. Reached through aiobotocore's private `_endpoint.http_session`; where this
      aiobotocore keeps it elsewhere, it is made on the first request, as before (a test says so);
    - the error classes, built on the first error answer (a new bucket's first read of `latest` is a
      404) by walking S3's whole model: about 45 ms on the event loop."""
    s3.exceptions  # noqa: B018
    http = getattr(getattr(s3, "_endpoint", None), "http_session", None)
    make = getattr(http, "_get_session", None)
    proxies = getattr(http, "_proxy_config", None)
    if make is not None and proxies is not None:
        await make(proxies.proxy_url_for(s3.meta.endpoint_url))


def _take_body_sha256(params: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
    digest = params.pop(BODY_SHA256, None)
    if digest is not None:
        context[BODY_SHA256] = digest


def _choose_known_digest_signer(
    signature_version: Any, signing_name: Any, context: dict[str, Any], **_: Any
) -> str | None:
    """Where botocore would sign with plain S3 SigV4 (the operation's `v4`, which its own handler maps to
    `s3v4` for S3): S3 Express, SigV4a, unsigned bodies and unsigned clients keep botocore's choice."""
    plain = (
        signature_version in ("v4", "s3v4") and signing_name == "s3" and not context.get("unsigned_payload")
    )
    return _SIGNER if plain and context.get(BODY_SHA256) else None


@functools.cache
def _register_signer() -> None:
    """Add the known-digest signer to botocore's signer table, under a name of its own."""
    import botocore.auth

    class KnownDigestS3SigV4Auth(botocore.auth.S3SigV4Auth):
        def payload(self, request: Any) -> str:
            digest = request.context.get(BODY_SHA256)
            if (
                digest
                and not self._is_streaming_checksum_payload(request)
                and self._should_sha256_sign_payload(request)
            ):
                return str(digest)
            return str(super().payload(request))

    botocore.auth.AUTH_TYPE_MAPS[_SIGNER] = KnownDigestS3SigV4Auth


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
            return SinkAuthError(msg, path=where, hint=s3_denied_hint(where, e.operation_name))
        if code == "NoSuchBucket":
            return missing_bucket(str(err.get("BucketName") or _bucket_of(where)), where, e.operation_name)
        return SinkError(f"{msg} (after the client's retries)", path=where)
    if isinstance(e, NoCredentialsError | PartialCredentialsError | CredentialRetrievalError):
        return SinkAuthError(f"{type(e).__name__}: {e}", path=where, hint=s3_denied_hint(where, None))
    return SinkError(f"{type(e).__name__}: {e} (after the client's retries)", path=where)


def missing_bucket(bucket: str, where: str, operation: str) -> SinkMissingError:
    """A store's `NoSuchBucket`: the sink's bucket is absent, which no retry of the request fixes."""
    return SinkMissingError(
        f"bucket {bucket!r} does not exist (NoSuchBucket from {operation})",
        path=where,
        hint=f"create the bucket (`aws s3 mb s3://{bucket}`), or fix the sink URL",
    )


def _bucket_of(where: str) -> str:
    return where.removeprefix("s3://").removeprefix("s3a://").split("/", 1)[0]


async def read_body(answer: dict[str, Any], limit: int | None = None) -> bytes:
    """The body of a `get_object` answer: whole, or its first `limit` bytes (all of a shorter one). A body
    left unread past `limit` drops its connection as it closes."""
    body = answer["Body"]  # not `async with ... as body`: aiobotocore 2.x enters its aiohttp response
    async with body:
        if limit is None:
            return bytes(await body.read())
        out = bytearray()  # read(n) gives what has arrived, up to n: a large object takes several
        while len(out) < limit and (chunk := await body.read(limit - len(out))):
            out += chunk
        return bytes(out)
