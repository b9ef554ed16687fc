"""Who made a commit, as the Hub's history names it, for a conflict's message: the Hub counterpart of the
publisher an S3 or file:// step's claim names (`sinks/claims.py`).

A Hub repo holds no claim. What it records of a commit is the Hub account(s) the commit is credited to and
its date; a stagerd commit's title and description name the step and its size, not the host or ROOT that
published it. So a conflict names the account and the date: two runs under one account are told apart by
the date alone.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from stagerd.errors.base import bounded
from stagerd.sinks.hub.client import hub_headers

_NAMED_CHARS = 64  # of one account's name, as the Hub's history gives it (anyone's with write access)
_NAMED_AUTHORS = 3


def committed_by(api: Any, repo_id: str, commit: str) -> str | None:
    """'Hub account NAME, YYYY-MM-DD HH:MM UTC' for `commit` of `repo_id` (one request, not retried), or None
    where the Hub names no account or cannot be asked: the message it goes into is the answer, not this."""
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.utils import paginate

    from stagerd.sinks.hub.http_lib import httpx
    from stagerd.sinks.hub.one_policy import Unretried

    url = f"{api.endpoint}/api/models/{repo_id}/commits/{quote(commit, safe='')}"
    try:
        item = next(iter(paginate(url, params={"limit": 1}, headers=hub_headers(api.token))), None)
    except (HfHubHTTPError, httpx.HTTPError, Unretried, OSError, ValueError):
        return None
    if not isinstance(item, dict) or item.get("id") != commit:
        return None
    return describe(item.get("authors"), item.get("date"))


def describe(authors: Any, date: Any) -> str | None:
    """The accounts in the Hub's `authors` list and its `date`, printable and bounded; None for no account."""
    listed = authors if isinstance(authors, list) else []
    names = [
        bounded(a["user"], _NAMED_CHARS)
        for a in listed
        if isinstance(a, dict) and isinstance(a.get("user"), str)
    ]
    if not names:
        return None
    more = ", ..." if len(names) > _NAMED_AUTHORS else ""
    who = f"Hub account{'s' if len(names) > 1 else ''} {', '.join(names[:_NAMED_AUTHORS])}{more}"
    when = _when(date)
    return f"{who}, {when}" if when else who


def _when(date: Any) -> str | None:
    try:
        at = datetime.fromisoformat(str(date))
    except ValueError:
        return None
    if at.tzinfo is None:
        at = at.replace(tzinfo=UTC)
    return at.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")
