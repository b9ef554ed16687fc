"""What a sink's refusal for want of permission tells the user to check, by the kind of its URL: only the
credentials that kind reads (the Hub's are `hub/errors.py`'s `auth_hint`)."""

from __future__ import annotations

from urllib.parse import urlsplit

AWS_CREDENTIALS = "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or the machine's role"


def s3_denied_hint(where: str, operation: str | None) -> str:
    """An S3 store that refused the request (`operation`, None where no request was signed)."""
    if operation is None:
        return f"give stagerd AWS credentials in its environment ({AWS_CREDENTIALS})"
    allowed = f"that they are allowed s3:{operation} on {where}"
    return f"check the AWS credentials ({AWS_CREDENTIALS}) and {allowed}"


def denied_hint(url: str) -> str:
    """A file:// (or other fsspec) sink whose path this process may not read or write."""
    scheme = urlsplit(url).scheme or "file"
    if scheme in ("file", "local"):
        return "check that the user stagerd runs as may read and write that path (its owner and mode)"
    return f"check the credentials the {scheme}:// filesystem reads and their permission on {url}"
