"""The test S3 proxy's check of AWS Signature Version 4, as S3 makes it: the canonical request rebuilt from
what arrived, signed again with the secret of the access key it names, and compared."""

from __future__ import annotations

import hashlib
import hmac
import urllib.parse
from collections.abc import Mapping


def sigv4_denied(
    keys: Mapping[str, str], method: str, path: str, query_string: str, headers: Mapping[str, str]
) -> str | None:
    """None if the request's SigV4 signature is good for one of `keys` (access key id -> secret); else the
    S3 error code S3 answers with (403): `AccessDenied`, `InvalidAccessKeyId` or `SignatureDoesNotMatch`.
    `headers` are lower-case, as they arrived."""
    auth = headers.get("authorization", "")
    if not auth.startswith("AWS4-HMAC-SHA256 "):
        return "AccessDenied"
    fields = dict(p.strip().split("=", 1) for p in auth[len("AWS4-HMAC-SHA256 ") :].split(","))
    akid, date, region, service, _ = fields["Credential"].split("/")
    secret = keys.get(akid)
    if secret is None:
        return "InvalidAccessKeyId"
    signed = fields["SignedHeaders"].split(";")
    pairs = sorted(urllib.parse.parse_qsl(query_string, keep_blank_values=True))
    canonical_query = "&".join(
        f"{urllib.parse.quote(k, safe='-_.~')}={urllib.parse.quote(v, safe='-_.~')}" for k, v in pairs
    )
    canonical_headers = "".join(f"{h}:{' '.join(headers.get(h, '').split())}\n" for h in signed)
    canonical = "\n".join(
        [
            method,
            path,
            canonical_query,
            canonical_headers,
            fields["SignedHeaders"],
            headers.get("x-amz-content-sha256", "UNSIGNED-PAYLOAD"),
        ]
    )
    scope = f"{date}/{region}/{service}/aws4_request"
    to_sign = "\n".join(
        ["AWS4-HMAC-SHA256", headers["x-amz-date"], scope, hashlib.sha256(canonical.encode()).hexdigest()]
    )
    k = f"AWS4{secret}".encode()
    for part in (date, region, service, "aws4_request"):
        k = hmac.new(k, part.encode(), hashlib.sha256).digest()
    good = hmac.new(k, to_sign.encode(), hashlib.sha256).hexdigest()
    return None if hmac.compare_digest(good, fields["Signature"]) else "SignatureDoesNotMatch"
