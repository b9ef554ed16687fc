"""How a sink URL reads in a message: quoted on one line as the user typed it, any password or token in it
masked (`objects.redact_url` masks the URLs the daemon logs)."""

from __future__ import annotations

import re
import urllib.parse

# a query option whose name holds one of these carries a secret: its value is masked (here and `redact_url`)
SECRET_PARAMS = ("token", "secret", "key", "password", "signature", "credential", "sig", "auth")
_AUTHORITY = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*:/*)(?P<authority>[^/]*)(?P<path>.*)", re.S)


def shown(text: str) -> str:
    """The URL quoted on one line as the user typed it (not percent-encoded again: a suggestion must read as
    what to type), with any password or token in it masked, as `redact_url` masks them."""
    if "@" in text or "?" in text:
        text = masked(text)
    return repr(text)


def masked(text: str) -> str:
    """`text` with the password of its authority (or a lone user part, often a key) and the values of its
    token- or secret-like query options as `***`, however many slashes follow the scheme."""
    base, sep, query = text.partition("?")
    # the authority after the scheme and its slashes, however many were typed (`s3:/user:pw@bucket`)
    if (m := _AUTHORITY.match(base)) is not None and "@" in m["authority"]:
        userinfo, host = m["authority"].rsplit("@", 1)
        hidden = f"{userinfo.split(':', 1)[0]}:***" if ":" in userinfo else "***"
        base = f"{m['scheme']}{hidden}@{host}{m['path']}"
    query, hash_, fragment = query.partition("#")
    pairs = []
    for pair in query.split("&") if sep else []:
        key, eq, _ = pair.partition("=")
        secret = any(s in urllib.parse.unquote_plus(key).lower() for s in SECRET_PARAMS)
        pairs.append(f"{key}=***" if eq and secret else pair)
    return base + sep + "&".join(pairs) + hash_ + fragment
