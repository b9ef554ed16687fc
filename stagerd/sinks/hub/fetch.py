"""A published step's HF export back from the Hub (`stagerd restore hf://ORG/REPO[@step-N] OUT --export`).

The revision is the step's tag (`--step N`: `step-N`, or `REVISION/step-N` for `hf://ORG/REPO@REVISION`, as
the sink tags steps off main; or that tag in the URL), its commit read from the refs, never a branch of its
name; else the URL's revision, else `main` (which holds the newest step). A step an older stagerd
published on REVISION under the unscoped names (`stagerd: step N`, tag `step-N`) is read at its commit, found
by the sink's own rule (`history.py`).
The revision is resolved to its commit once, so a step published to the branch during the restore mixes
nothing in. Every file of the Hub's tree at that commit (but `.gitattributes`) is downloaded (one stored in
Xet through hf_xet on a session of the restore's own, `xet_fetch.py`; the rest by one GET an attempt,
`file_fetch.py`) into a temporary sibling of OUT and checked against the tree: its size, and its LFS sha256
or, for a small file kept in git, its git blob id. Only then is the directory renamed to OUT. A mismatch, or
Xet data that does not rebuild, is a `RestoreError` naming the file; nothing is left behind. Each request is
bounded by the URL's timeouts and tried as often as the URL's `max_attempts` says, as the sink tries its own:
each by `tried` alone (huggingface_hub retries none of the Hub API's itself: `one_policy.py`); hf_xet tries
each Xet request itself, as often. A file's attempts begin again after a round of them that brought it on by
`_CHUNK` bytes or more (`_going_on`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path, PureWindowsPath
from typing import Any

from stagerd.contract import layout
from stagerd.errors import ConfigError, MarkerError, RestoreError, SinkAuthError, SinkError
from stagerd.ops.crashpoints import crash_point
from stagerd.sinks.base import ProgressFn
from stagerd.sinks.hub.client import hub_api, hub_headers
from stagerd.sinks.hub.errors import auth_hint, classify, refuse_offline, restore_retry_hint
from stagerd.sinks.hub.file_fetch import fetch_once, resolve_url
from stagerd.sinks.hub.held import not_here, sink_revision, step_of_tag, steps_by_revision
from stagerd.sinks.hub.history import commit_pages, older_stagerds_step
from stagerd.sinks.hub.one_policy import Unretried
from stagerd.sinks.hub.options import sink_arguments
from stagerd.sinks.hub.retries import tried
from stagerd.sinks.hub.timeouts import HubTimeouts, register_timeouts, unregister_timeouts
from stagerd.sinks.hub.url import (
    DEFAULT_REVISION,
    GITATTRIBUTES,
    RetryPolicy,
    T,
    parse_hub_url,
    revision_scope,
    step_tag,
)
from stagerd.sinks.hub.xet import xet_enabled
from stagerd.sinks.hub.xet_fetch import XetDownloader
from stagerd.sinks.temp_names import restore_temp

_CHUNK = 8 << 20
log = logging.getLogger("stagerd")
# Unless the URL says: the sink's eight, with backoff up to a minute, would keep a restore (a job's resume
# waiting on it) from a Hub that is down going for many minutes.
RESTORE_ATTEMPTS = 3


def _going_on(retried: Callable[[Callable[[], None]], None], fetch: Callable[[], None], got: Path) -> None:
    """`retried(fetch)`, begun again while a round of its attempts ends with `_CHUNK` bytes or more of the
    file than it began with: each attempt asks for the rest, so over a link that keeps dropping a big file
    still comes whole, while one that trickles a few bytes an attempt ends within the URL's attempts."""
    from stagerd.sinks.hub.http_lib import httpx

    def have() -> int:
        return got.stat().st_size if got.exists() else 0

    before = have()
    while True:
        try:
            return retried(fetch)
        except httpx.TransportError:
            now = have()
            if now - before < _CHUNK:
                raise
            log.warning(
                "%s: cut off at byte %d, %d bytes on: its attempts begin again", got.name, now, now - before
            )
            before = now


def _digests(path: Path, size: int) -> tuple[str, str]:
    sha, git = hashlib.sha256(), hashlib.sha1(b"blob %d\0" % size)
    with open(path, "rb", buffering=0) as f:
        while data := f.read(_CHUNK):
            sha.update(data)
            git.update(data)
    return sha.hexdigest(), git.hexdigest()


def _revision(url_revision: str | None, step: int | None) -> str:
    """The revision to read: the step's tag on the URL's revision (`step-N` on main, `REVISION/step-N` on
    another, as the sink tags it), else the URL's revision, else `main`."""
    if step is None:
        return url_revision or DEFAULT_REVISION
    named = step_of_tag(url_revision or "")
    if named is None:
        return step_tag(step, url_revision)
    if named[0] != step:  # the URL already names a step's tag
        raise ConfigError(f"the URL names revision {url_revision!r} and --step names step {step}")
    return str(url_revision)


class _Restore:
    """The owner of a restore's request bounds (`register_timeouts` holds its owners weakly)."""


def restore_hub_export(url: str, out: Path, step: int | None, *, progress: ProgressFn | None = None) -> Path:
    """Download the export at the step's revision into the new directory `out`, checked against the tree,
    every request bounded by the URL's timeouts and retried under its retry policy, as the sink's are."""
    from huggingface_hub import HfApi

    given = parse_hub_url(url).options
    arguments = sink_arguments(url, {} if "max_attempts" in given else {"max_attempts": RESTORE_ATTEMPTS})[1]
    owner = _Restore()
    register_timeouts(owner, HfApi(endpoint=arguments["endpoint"]).endpoint, arguments["timeouts"])
    try:
        return _restore(url, out, step, arguments["retry"], arguments["timeouts"], progress)
    finally:
        unregister_timeouts(owner)


def _restore(
    url: str,
    out: Path,
    step: int | None,
    policy: RetryPolicy,
    timeouts: HubTimeouts,
    progress: ProgressFn | None,
) -> Path:
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    from stagerd.sinks.hub.http_lib import httpx

    # a Hub that refuses, drops or times out a connection: httpx's own errors, not HfHubHTTPError
    unreachable = (httpx.TransportError, ConnectionError, TimeoutError, Unretried)

    target = parse_hub_url(url)
    revision = _revision(target.revision, step)
    endpoint, token = target.options.get("endpoint"), target.options.get("token")
    where = f"hf://{target.repo_id}@{revision}"
    refuse_offline(where)
    api = hub_api(endpoint, token)  # no token: HF_TOKEN or the login, as the sink
    denied, again = auth_hint(target.repo_id, write=False), restore_retry_hint(target.repo_id)

    def retried(fn: Callable[[], T]) -> T:
        # a missing repo or revision is an answer: the restore names it
        return tried(
            fn, policy, where=where, token=token, answers=(RepositoryNotFoundError, RevisionNotFoundError)
        )

    asked, named = revision, step_of_tag(revision)

    def lacking(what: str) -> RestoreError:
        """The error for what the repo lacks, naming the steps its tags show (unless they cannot be read)."""
        try:
            held = retried(lambda: steps_by_revision(api, target.repo_id))
        except (HfHubHTTPError, SinkError, *unreachable):
            held = None
        wanted = named[0] if named is not None else step
        return not_here(what, where, target.repo_id, sink_revision(asked), wanted, held)

    never = "that step was never published to it" if named is not None else "no step was published to it"
    try:
        # a step's tag, from `--step N` or named in the URL (`@step-N`): read from the refs, since the Hub
        # reads a name that is a branch and a tag as the branch
        if named is not None:
            tag_step, scope = named
            tagged = retried(lambda: _step_commit(api, target.repo_id, scope, tag_step))
            if tagged is None and step is not None:
                raise lacking(f"the repo has no revision {revision}: {never}")
            revision = tagged or revision  # no such tag: the URL's revision as the Hub reads it
        # one commit for every file: a step published to the branch meanwhile must not mix in
        commit = retried(lambda: api.repo_info(target.repo_id, revision=revision).sha) or revision
        tree: list[Any] = retried(
            lambda: [
                e
                for e in api.list_repo_tree(target.repo_id, revision=commit, recursive=True)
                if hasattr(e, "size")
            ]
        )
    except RevisionNotFoundError:
        # the repo is readable (a repo the token cannot see is RepositoryNotFoundError): the step is not there
        raise lacking(f"the repo has no revision {asked}: {never}") from None
    except GatedRepoError as e:  # a RepositoryNotFoundError to huggingface_hub, but the repo is there
        status = getattr(e.response, "status_code", None)
        raise SinkAuthError(
            f"the repo is gated and the token's account has not been granted access ({status})",
            path=where,
            hint=f"request access on the repo's page ({api.endpoint}/{target.repo_id}) with the account of "
            "the token, or set HF_TOKEN (or ?token=) to a token whose account has it; nothing was restored",
        ) from None
    except RepositoryNotFoundError as e:
        hint = (
            "check the repo's name (it holds nothing before a daemon's first publish there); for a private "
            "repo, set HF_TOKEN (or ?token=) to a token that can read it"
        )  # the Hub answers 404 alike for no such repo and for a private one the token cannot read
        raise RestoreError(
            f"not found: {type(e).__name__} (no such repo, or a private one the token cannot read)",
            path=where,
            hint=hint,
        ) from None
    except HfHubHTTPError as e:
        status = getattr(e.response, "status_code", None)
        if status in (401, 403):
            raise SinkAuthError(f"the Hub refused the token ({status})", path=where, hint=denied) from None
        raise SinkError(f"the Hub failed: {status}", path=where, hint=again) from None
    except unreachable as e:
        raise SinkError(f"cannot reach the Hub: {classify(e).text}", path=where, hint=again) from None
    files = [e for e in tree if e.path != GITATTRIBUTES]
    if not files:
        raise (
            lacking("holds no files: no step was published to it")
            if step is None
            else RestoreError("holds no files", path=where)
        )
    _check_tree([e.path for e in files], where)
    tmp = restore_temp(out)
    total, done = sum(int(f.size) for f in files), 0
    # Xet files on a hf_xet session of the restore's own, bounded as the rest: huggingface_hub's is not.
    # hf_xet tries each request as often as the URL says, so the call is not retried again.
    headers = hub_headers(token)
    xet = XetDownloader(
        timeouts,
        policy.max_attempts,
        endpoint=api.endpoint,
        repo_id=target.repo_id,
        commit=commit,
        headers=headers,
    )
    use_xet = xet_enabled()
    try:
        tmp.mkdir(parents=True)
        for entry in files:
            xet_hash = getattr(entry, "xet_hash", None) if use_xet else None
            got = tmp / entry.path
            try:
                if xet_hash:
                    xet.download(xet_hash, int(entry.size), got, f"{where}/{entry.path}")
                else:  # no HEAD: the tree names its size and hash
                    file_url = resolve_url(api.endpoint, target.repo_id, commit, entry.path)
                    _going_on(retried, lambda: fetch_once(file_url, got, int(entry.size), headers), got)  # noqa: B023
            except HfHubHTTPError as err:
                status = getattr(err.response, "status_code", None)
                at = f"{where}/{entry.path}"
                raise SinkError(f"download failed: {status}", path=at, hint=again) from None
            except httpx.TransportError as err:
                why = classify(err).text
                raise SinkError(f"download failed: {why}", path=f"{where}/{entry.path}", hint=again) from None
            except (RuntimeError, ConnectionError) as err:  # hf_xet's: a CAS failure, or data it cannot read
                raise xet.error(err, f"{where}/{entry.path}") from None
            size = got.stat().st_size
            sha, git = _digests(got, size)
            lfs = getattr(entry, "lfs", None)
            want = lfs.sha256 if lfs is not None else entry.blob_id
            have = sha if lfs is not None else git
            if size != entry.size or have != want:
                raise RestoreError(
                    f"is {size} bytes with {'sha256' if lfs else 'git blob id'} {have}; the Hub's tree "
                    f"lists {entry.size} bytes and {want}",
                    path=f"{where}/{entry.path}",
                )
            done += size
            if progress is not None:
                progress(done, total)
            crash_point("restore.piece")
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _check_tree(rels: list[str], where: str) -> None:
    """Refuse, before any download, a tree (the Hub's, so anyone's) that no export directory can hold: a
    name leaving it, one listed as a file and a directory, one Windows cannot hold, or one under `.cache/`,
    where huggingface_hub keeps its download metadata when the export is downloaded into a directory
    (`local_dir`), so such a file would go with it."""
    try:
        for rel in rels:
            layout.safe_relpath(rel, what="file", path=where)
        layout.check_file_tree(rels, what="file", path=where)
    except MarkerError as e:
        raise RestoreError(f"the repo's tree is no export: {e.message}", path=where) from None
    # as huggingface_hub refuses, on every platform, a name Windows reads as anchored (`C:x`, `a/d:x`)
    drive = next((r for r in rels if any(_anchored(part) for part in r.split("/"))), None)
    if drive is not None:
        raise RestoreError(
            f"the repo's tree is no export: file {drive!r} names a Windows drive, which huggingface_hub "
            "refuses to download",
            path=where,
        )
    cached = next((r for r in rels if r.split("/", 1)[0] == ".cache"), None)
    if cached is not None:
        raise RestoreError(f"the repo's tree is no export: file {cached!r} is under .cache/", path=where)


def _anchored(part: str) -> bool:
    windows = PureWindowsPath(part)
    return bool(windows.drive or windows.root)


def _step_commit(api: Any, repo_id: str, revision: str | None, step: int) -> str | None:
    """The commit the step's tag marks, read from the refs (on the Hub a branch of the tag's name wins
    over the tag), else the commit of `step` an older stagerd published on `revision` under unscoped
    names; None where neither is there."""
    refs = api.list_repo_refs(repo_id)
    tags = {t.name: t.target_commit for t in refs.tags}
    tagged = tags.get(step_tag(step, revision))
    if tagged is not None or revision is None or not revision_scope(revision):
        return tagged
    branches = {b.name: b.target_commit for b in refs.branches}
    pages = commit_pages(
        api.endpoint,
        repo_id,
        hub_headers(api.token),
    )
    return older_stagerds_step(pages, step, revision, branches, tags)
