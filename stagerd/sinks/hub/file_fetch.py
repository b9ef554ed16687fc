"""One file of a restore that is not read from Xet, fetched in one GET per attempt of the sink's policy.

`hf_hub_download` sends a HEAD for the file's metadata first and, where it fails in a way huggingface_hub
retries, sends it six times more with 1 to 8 s between (23 s asleep), then reads the body with up to five
resumes of its own: none of it counted by the URL's `max_attempts`, so a hung Hub held a restore with
`max_attempts=1&timeout=0.5` for 27 s. The restore needs no HEAD: the tree listing it checks every file
against already names the size and the hash. So each attempt is one GET of the file at the commit; the
caller's `tried` counts it. A body cut off mid-way is not read again: the next attempt asks for the rest
(`Range`), so a resend is of what is missing only.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote


def resolve_url(endpoint: str, repo_id: str, commit: str, path: str) -> str:
    return f"{endpoint.rstrip('/')}/{repo_id}/resolve/{commit}/{quote(path, safe='/')}"


def fetch_once(url: str, dest: Path, size: int, headers: dict[str, str]) -> None:
    """One attempt: the file's bytes not yet in `dest` (all of them, if the Hub ignores the range)."""
    from huggingface_hub.utils import get_session, hf_raise_for_status

    dest.parent.mkdir(parents=True, exist_ok=True)
    have = dest.stat().st_size if dest.exists() else 0
    if have > size:  # not this file's prefix: start over
        dest.unlink()
        have = 0
    if have == size and size > 0:
        return
    # identity: a range of a gzip-encoded answer is of the encoded bytes, which no later range continues
    ask = {**headers, "Accept-Encoding": "identity", **({"Range": f"bytes={have}-"} if have else {})}
    with get_session().stream("GET", url, headers=ask) as response:
        if response.is_error:
            response.read()  # the error names the Hub's message
        hf_raise_for_status(response)
        mode = "ab" if have and response.status_code == 206 else "wb"
        with open(dest, mode) as f:
            for chunk in response.iter_bytes():  # as it comes: what came before a stall is kept
                f.write(chunk)
