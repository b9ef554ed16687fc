"""Where stagerd meets the aiobotocore client: its failures as named sink errors, the answers of
conditional writes, and the payload hash the client signs.

**The signed payload hash.** Over plain http (and wherever payload signing is on), SigV4 signs the sha256
of the request body: botocore hashes every PUT's body and sends the hex digest as `X-Amz-Content-SHA256`,
which the store checks against the body it receives. For a file sent in one PUT that body is the whole
file, so that digest is the file's sha256 for the manifest: taking it saves a second sha256 pass over the
file. `hook_client` registers two handlers on the client's events for this: a call made with
`PAYLOAD_SHA256=[...]` gets each attempt's header appended to that list. Over https with a checksum,
botocore sends `UNSIGNED-PAYLOAD` instead, and the uploader hashes the file itself.
"""

from __future__ import annotations

import re
from typing import Any

from stagerd.errors import SinkAuthError, SinkError

PAYLOAD_SHA256 = "StagerdPayloadSha256"  # not an S3 parameter: popped before botocore validates the call
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


def _take_payload_list(params: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
    sink = params.pop(PAYLOAD_SHA256, None)
    if sink is not None:
        context[PAYLOAD_SHA256] = sink


def _record_payload_sha256(request: Any, **_: Any) -> None:
    sink = (getattr(request, "context", None) or {}).get(PAYLOAD_SHA256)
    if sink is not None:
        value = request.headers.get("X-Amz-Content-SHA256")
        sink.append(value.decode() if isinstance(value, bytes) else value)


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
