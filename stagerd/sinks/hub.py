"""`HubSink`: publish an export to a Hugging Face Hub model repo, one atomic commit per step.

URL: `hf://ORG/REPO[@REVISION][?option=value&...]`. Options (keyword arguments win over the query):
`token` (default: `HF_TOKEN` or the huggingface_hub login), `endpoint` (default: `HF_ENDPOINT` or the
public Hub), `private` (default true: a missing repo is created private), `branch_per_step` (default
false: each step is committed to `REVISION`, `main` by default), and the retry knobs `max_attempts`,
`backoff_base`, `backoff_max`, `max_retry_after` (seconds), and the request bounds `timeout` (seconds the
Hub may keep any one request waiting, default 60) and `connect_timeout` (default 10).

One publish is exactly one `HfApi.create_commit` (never `upload_folder`, which may split a folder into
several commits) with the message `stagerd: step N`, then the tag `step-N` on that commit. The commit
names its `parent_commit`, so a concurrent writer makes it fail (and be re-planned) instead of being
overwritten, and it deletes files of the previous step that the export lacks, so the revision holds
exactly the export (plus `.gitattributes` and the generated `README.md`).

Idempotence is read from the repo itself: the tag `step-N` means published; a commit titled
`stagerd: step N` without the tag (a crash between commit and tag) gets the tag and nothing else. LFS
objects the repo already holds are not sent again (the LFS batch answers them without actions), so a
re-run after a crash mid-upload sends only what is missing. Before returning, the tree at the commit is
listed and compared with the export: names, sizes, LFS sha256 or the git blob id.

A crash between commit and tag leaves the step's commit near the head of its branch (steps are committed in
increasing order), so the history is read newest first, page by page, only until that commit, a stagerd
commit of an earlier step, or `_HISTORY_CAP` commits, so that walk does not grow with the history (the refs
listing still does: it names every `step-N` tag).

Every request is bounded: huggingface_hub 2.4 shares one HTTP client per process with no timeout and offers
no per-`HfApi` client, so the sink installs (once, through `set_client_factory`) a request hook that bounds
each request to a registered endpoint by that endpoint's timeouts, and requests elsewhere (LFS upload URLs)
by the most generous registered bound. A request the Hub leaves unanswered ends in a retryable "the Hub
did not answer within N s".

Errors: 401/403 (or a repo the token cannot see) raise `SinkAuthError` at once; 429 waits for
`Retry-After`; 5xx, 408, 409/412 (a moved branch), timeouts and dropped connections are retried with
bounded exponential backoff; other failures raise `SinkError`. The token never appears in messages or logs.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from functools import reduce
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar
from urllib.parse import parse_qsl, quote, urlsplit

from stagerd.errors import (
    ConfigError,
    SinkAuthError,
    SinkConflictError,
    SinkError,
    StagerdError,
    VerifyError,
)
from stagerd.ops.crashpoints import crash_point
from stagerd.sinks.base import ProgressFn, PublishResult
from stagerd.sinks.model_card import CARD_NAME, CardInfo, export_dtypes, render_model_card

if TYPE_CHECKING:
    import httpx2

log = logging.getLogger("stagerd.sinks.hub")

T = TypeVar("T")
N = TypeVar("N", int, float)

GITATTRIBUTES = ".gitattributes"
# The Hub stores files above 10 MB in LFS whatever their name; below, a file may be a plain git blob,
# whose tree entry carries only the git blob id, so that id is computed for small files.
_GIT_OID_MAX = 10 * 1024 * 1024
_FORBIDDEN_DIRS = {".git", ".cache", ".huggingface"}
_HASH_CHUNK = 8 << 20
_STEP_TITLE = re.compile(r"^stagerd: step (\d+)$")
_HISTORY_PAGE = 50  # commits per request while looking for a step's commit
_HISTORY_CAP = 1000  # commits read at most per branch and publish


def commit_message(step: int) -> str:
    return f"stagerd: step {step}"


def step_tag(step: int) -> str:
    return f"step-{step}"


def step_branch(step: int) -> str:
    return f"stagerd/step-{step}"


# --- the URL ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded exponential backoff: attempt k waits about `base * 2**(k-1)`, never over `max_delay`.

    A 429 waits for its `Retry-After` instead; one longer than `max_retry_after` ends the publish with a
    retryable `SinkError`, so the daemon reschedules the step rather than block a worker that long.
    """

    max_attempts: int = 8
    backoff_base: float = 1.0
    backoff_max: float = 60.0
    max_retry_after: float = 600.0

    def delay(self, attempt: int) -> float:
        return min(self.backoff_max, self.backoff_base * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)


@dataclass(frozen=True)
class HubTarget:
    """A parsed `hf://` URL: the repo, the revision named in it (if any), and its query options."""

    repo_id: str
    revision: str | None
    options: dict[str, str]

    @property
    def redacted(self) -> str:
        return f"hf://{self.repo_id}" + (f"@{self.revision}" if self.revision else "")


def parse_hub_url(url: str) -> HubTarget:
    """Split `hf://ORG/REPO[@REVISION][?k=v...]`. A malformed URL is a ConfigError (without the query)."""
    parts = urlsplit(url)
    shown = url.split("?", 1)[0]
    if parts.scheme != "hf":
        raise ConfigError(f"not a Hub sink URL: {shown!r} (expected hf://ORG/REPO[@REVISION])")
    path = (parts.netloc + parts.path).strip("/")
    repo_id, _, revision = path.partition("@")
    if repo_id.count("/") != 1 or not all(repo_id.split("/")) or (revision == "" and "@" in path):
        raise ConfigError(f"bad Hub sink URL {shown!r}: expected hf://ORG/REPO[@REVISION]")
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise ConfigError(f"bad repo id in {shown!r}: {e}") from None
    return HubTarget(repo_id, revision or None, dict(parse_qsl(parts.query)))


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"Hub sink option {name}={value!r} is not a boolean")


def _number(opts: Mapping[str, Any], name: str, default: N, cast: Callable[[Any], N]) -> N:
    """Option `name` as a number (`cast`), or `default`; a non-number is a ConfigError naming the option."""
    try:
        return cast(opts.get(name, default))
    except (TypeError, ValueError):
        raise ConfigError(f"Hub sink option {name}={opts[name]!r} is not a number") from None


# --- request bounds -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HubTimeouts:
    """How long one Hub request may wait: `connect` for the connection, `read` for anything else.

    `read` also bounds waiting to send more of an upload (the server stopped reading) and waiting for a
    free connection of the shared pool.
    """

    read: float = 60.0
    connect: float = 10.0

    def __post_init__(self) -> None:
        for name in ("read", "connect"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not 0 < value < float("inf"):
                raise ConfigError(
                    f"Hub sink {name} timeout must be a positive number of seconds, got {value!r}"
                )

    def limits(self) -> dict[str, float]:
        """The bound of each of httpx's four timeouts."""
        return {"connect": self.connect, "read": self.read, "write": self.read, "pool": self.read}

    def widest(self, other: HubTimeouts) -> HubTimeouts:
        return HubTimeouts(max(self.read, other.read), max(self.connect, other.connect))


# owner (a HubSink) -> (origin, its bound). Weak, so a sink that is gone no longer widens anyone's bound.
_BOUNDS: weakref.WeakKeyDictionary[object, tuple[str, HubTimeouts]] = weakref.WeakKeyDictionary()
_BOUNDS_LOCK = threading.Lock()
_hook_installed = False
_DEFAULT_PORTS = {"http": 80, "https": 443}


def _origin(scheme: str, host: str | None, port: int | None) -> str:
    scheme = scheme.lower()
    return f"{scheme}://{(host or '').lower()}:{port or _DEFAULT_PORTS.get(scheme, 0)}"


def register_timeouts(owner: object, endpoint: str, timeouts: HubTimeouts) -> None:
    """Bound every huggingface_hub request of this process to `endpoint` by `timeouts`, while `owner` lives.

    Two owners on one endpoint get the wider of their bounds (the HTTP client is shared, so one cannot be
    stricter than the other). The first call installs the request hook.
    """
    global _hook_installed
    parts = urlsplit(endpoint)
    with _BOUNDS_LOCK:
        _BOUNDS[owner] = (_origin(parts.scheme, parts.hostname, parts.port), timeouts)
        if not _hook_installed:
            _install_request_hook()
            _hook_installed = True


def unregister_timeouts(owner: object) -> None:
    """Forget `owner`'s bound (requests stay bounded: by other owners' bounds, else the defaults)."""
    with _BOUNDS_LOCK:
        _BOUNDS.pop(owner, None)


def _bound_for(origin: str) -> HubTimeouts:
    with _BOUNDS_LOCK:
        entries = list(_BOUNDS.values())
    # LFS uploads go to URLs the Hub hands out (a CDN, a bucket) that no sink can name in advance: those
    # get the widest bound of any sink.
    pool = [t for o, t in entries if o == origin] or [t for _, t in entries] or [HubTimeouts()]
    return reduce(HubTimeouts.widest, pool)


def _bound_request(request: httpx2.Request) -> None:
    """httpx request hook: no timeout of `request` is unset or above the bound of its origin."""
    url = request.url
    bound = _bound_for(_origin(url.scheme, url.host, url.port)).limits()
    asked = request.extensions.get("timeout") or {}
    request.extensions["timeout"] = {
        k: limit if asked.get(k) is None else min(asked[k], limit) for k, limit in bound.items()
    }


def _install_request_hook() -> None:
    """Make every client huggingface_hub creates from now on carry `_bound_request`."""
    from huggingface_hub import set_client_factory
    from huggingface_hub.utils import _http

    # Wrap the factory in place (the library's default, or one the application set for proxies or
    # certificates) instead of replacing it; 2.4 has no public getter for it.
    previous = getattr(_http, "_GLOBAL_CLIENT_FACTORY", _http.default_client_factory)

    def factory() -> httpx2.Client:
        client = previous()
        client.event_hooks["request"].append(_bound_request)
        return client

    set_client_factory(factory)


# --- the export ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LocalFile:
    """One export file: path relative to the export (posix), size, sha256, and git blob id if small."""

    path: str
    size: int
    sha256: str
    git_oid: str | None


def _hash_file(path: Path, size: int) -> tuple[str, str | None]:
    sha = hashlib.sha256()
    git = hashlib.sha1(b"blob %d\0" % size) if size <= _GIT_OID_MAX else None
    buf = bytearray(min(_HASH_CHUNK, max(size, 1)))
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            sha.update(view[:n])
            if git is not None:
                git.update(view[:n])
    return sha.hexdigest(), None if git is None else git.hexdigest()


def scan_export(export_dir: Path, *, threads: int = 2) -> list[LocalFile]:
    """Every regular file under `export_dir`, hashed once. Bad input is a VerifyError naming the file."""
    if not export_dir.is_dir():
        raise VerifyError("export directory does not exist", path=export_dir)
    root = export_dir.resolve()
    found: list[tuple[str, Path, int]] = []
    for dirpath, dirnames, filenames in os.walk(export_dir, followlinks=False):
        dirnames.sort()
        for name in sorted(filenames) + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            p = Path(dirpath) / name
            rel = p.relative_to(export_dir).as_posix()
            if _FORBIDDEN_DIRS & set(rel.split("/")[:-1]):
                raise VerifyError("is inside a folder the Hub refuses (.git/.cache/.huggingface)", path=p)
            real = p.resolve()
            if not real.is_relative_to(root):
                raise VerifyError(f"resolves outside the export, to {real}", path=p)
            if not real.is_file():
                raise VerifyError("is not a regular file", path=p)
            found.append((rel, real, real.stat().st_size))
    if not found:
        raise VerifyError("export directory is empty", path=export_dir)
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        hashes = list(pool.map(lambda f: _hash_file(f[1], f[2]), found))
    return [LocalFile(rel, size, sha, git) for (rel, _, size), (sha, git) in zip(found, hashes, strict=True)]


# --- planning (pure) ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RemoteFile:
    """One file of a remote tree: size, git blob id, and the LFS sha256 when the file is in LFS."""

    path: str
    size: int
    blob_id: str
    lfs_sha256: str | None


@dataclass(frozen=True)
class CommitPlan:
    """What one step's commit does, relative to its parent tree."""

    adds: tuple[str, ...]
    deletes: tuple[str, ...]
    new_bytes: int  # upper bound of what must be uploaded: files whose content the parent lacks


def _same(local: LocalFile, remote: RemoteFile) -> bool:
    if remote.size != local.size:
        return False
    if remote.lfs_sha256 is not None:
        return remote.lfs_sha256 == local.sha256
    return local.git_oid is not None and remote.blob_id == local.git_oid


def plan_commit(
    local: Sequence[LocalFile], card: LocalFile | None, parent: Mapping[str, RemoteFile]
) -> CommitPlan:
    """Add every export file (and the card), delete what the parent holds beyond them."""
    files = [*local, *([card] if card else [])]
    keep = {f.path for f in files} | {GITATTRIBUTES}
    deletes = tuple(sorted(p for p in parent if p not in keep))
    new_bytes = sum(f.size for f in files if f.path not in parent or not _same(f, parent[f.path]))
    return CommitPlan(tuple(f.path for f in files), deletes, new_bytes)


def compare_tree(
    local: Sequence[LocalFile], card: LocalFile | None, remote: Mapping[str, RemoteFile], *, card_exact: bool
) -> list[str]:
    """Differences between the export and a remote tree; empty when the remote holds the export.

    The generated card is compared byte for byte only when `card_exact` (a commit just made); on an
    earlier commit it only has to exist, since run metadata may have been rendered differently.
    """
    problems = []
    for f in local:
        r = remote.get(f.path)
        if r is None:
            problems.append(f"{f.path}: missing")
        elif r.size != f.size:
            problems.append(f"{f.path}: {r.size} bytes on the Hub, {f.size} in the export")
        elif not _same(f, r):
            problems.append(f"{f.path}: content differs (sha256/blob id)")
    expected = {f.path for f in local} | {GITATTRIBUTES}
    if card is not None:
        expected.add(card.path)
        r = remote.get(card.path)
        if r is None:
            problems.append(f"{card.path}: missing")
        elif card_exact and not _same(card, r):
            problems.append(f"{card.path}: content differs from the generated model card")
    problems += [f"{p}: not in the export" for p in sorted(set(remote) - expected)]
    return problems


def scan_history(
    commits: Iterable[tuple[str, str]], step: int, *, cap: int = _HISTORY_CAP
) -> tuple[int | None, str | None]:
    """(step of the newest commit if stagerd made it, id of the commit titled for `step`) from (id, title)
    pairs, newest first.

    Reading stops at that commit, at a stagerd commit of an earlier step (stagerd commits a branch's steps
    in increasing order, so the sought one cannot be older), or after `cap` commits.
    """
    head_step: int | None = None
    read = 0
    for read, (oid, title) in enumerate(islice(commits, cap), start=1):
        m = _STEP_TITLE.match(title)
        seen = int(m.group(1)) if m else None
        if read == 1:
            head_step = seen
        if seen == step:
            return head_step, oid
        if seen is not None and seen < step:
            return head_step, None
    if read == cap:
        log.warning(
            "step %d: no commit for it in the newest %d commits; taking it as not committed", step, cap
        )
    return head_step, None


# --- errors ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Failure:
    """How a failed call is handled: `auth` (raise now), `retry` (backoff or Retry-After), `fatal`."""

    kind: Literal["auth", "retry", "fatal"]
    text: str
    retry_after: float | None = None


def _chain(exc: BaseException) -> Iterable[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def _retry_after(headers: Mapping[str, str]) -> float | None:
    from huggingface_hub.utils import parse_ratelimit_headers

    info = parse_ratelimit_headers(headers)
    if info is not None and info.remaining == 0:
        return float(info.reset_in_seconds)
    value = headers.get("retry-after")
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def classify(exc: BaseException) -> Failure:
    """Map an exception from huggingface_hub/httpx2 (possibly wrapped) to how the sink handles it."""
    import httpx2
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    for e in _chain(exc):
        if isinstance(e, HfHubHTTPError) and e.response is not None:
            response = e.response
            status = response.status_code
            request = response.request
            where = f"{request.method} {request.url.path}" if request is not None else "request"
            detail = (e.server_message or str(e).splitlines()[0]).strip().replace("\n", "; ")
            text = f"HTTP {status} on {where}: {detail}"
            if status in (401, 403) or isinstance(e, RepositoryNotFoundError | GatedRepoError):
                return Failure("auth", text)
            if status == 429:
                return Failure("retry", text, _retry_after(response.headers))
            if (
                status in (408, 409, 412, 423)
                or status >= 500
                or e.response.headers.get("X-Error-Code") in ("RevisionNotFound",)
            ):
                return Failure("retry", text)
            return Failure("fatal", text)
        if isinstance(e, httpx2.TimeoutException):
            return Failure("retry", _timeout_text(e))
        if isinstance(e, httpx2.TransportError | ConnectionError | TimeoutError):
            return Failure("retry", f"connection failed: {type(e).__name__}: {e}")
    return Failure("fatal", f"{type(exc).__name__}: {exc}")


def _timeout_text(exc: httpx2.TimeoutException) -> str:
    """'the Hub did not answer within N s (read timeout on METHOD /path)'; the path only, never a query."""
    import httpx2

    kinds = {httpx2.ConnectTimeout: "connect", httpx2.WriteTimeout: "write", httpx2.PoolTimeout: "pool"}
    kind = kinds.get(type(exc), "read")
    what = "accept the connection" if kind == "connect" else "answer"
    try:
        request = exc.request
    except RuntimeError:  # raised by httpx when no request is attached
        return f"the Hub did not {what} in time ({kind} timeout)"
    seconds = (request.extensions.get("timeout") or {}).get(kind)
    within = "in time" if seconds is None else f"within {seconds:g} s"
    return f"the Hub did not {what} {within} ({kind} timeout on {request.method} {request.url.path})"


_TOKEN_RE = re.compile(r"(hf_[A-Za-z0-9]{6,}|(?i:bearer)\s+\S+)")


# --- the sink -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Outcome:
    commit: str
    skipped: bool
    uploaded: int


class HubSink:
    """Publishes exports to one Hub repo. Thread-safe; see the module docstring for the protocol."""

    def __init__(
        self,
        repo_id: str,
        *,
        revision: str | None = None,
        token: str | None = None,
        endpoint: str | None = None,
        private: bool = True,
        branch_per_step: bool = False,
        retry: RetryPolicy | None = None,
        hash_threads: int = 2,
        num_threads: int = 5,
        timeouts: HubTimeouts | None = None,
    ) -> None:
        from huggingface_hub import HfApi, get_token

        self.repo_id = repo_id
        self.revision = revision or "main"
        self.private = private
        self.branch_per_step = branch_per_step
        self.retry = retry or RetryPolicy()
        self.url = HubTarget(repo_id, revision, {}).redacted
        self._token = token or get_token()
        self._api = HfApi(endpoint=endpoint, token=self._token, library_name="stagerd")
        self.timeouts = timeouts or HubTimeouts()
        register_timeouts(self, self._api.endpoint, self.timeouts)
        self._hash_threads = hash_threads
        self._num_threads = num_threads
        self._repo_ready = False
        self._lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str, **options: Any) -> HubSink:
        """Build a sink from `hf://ORG/REPO[@REVISION][?opts]`; keyword options override the query."""
        target = parse_hub_url(url)
        opts: dict[str, Any] = {**target.options, **options}
        known = {"token", "endpoint", "private", "branch_per_step", "max_attempts", "backoff_base"}
        known |= {"backoff_max", "max_retry_after", "hash_threads", "num_threads", "retry"}
        known |= {"timeout", "connect_timeout"}
        unknown = sorted(set(opts) - known)
        if unknown:
            raise ConfigError(f"unknown Hub sink option(s) {', '.join(unknown)} for {target.redacted}")
        retry = opts.get("retry") or RetryPolicy(
            max_attempts=_number(opts, "max_attempts", RetryPolicy.max_attempts, int),
            backoff_base=_number(opts, "backoff_base", RetryPolicy.backoff_base, float),
            backoff_max=_number(opts, "backoff_max", RetryPolicy.backoff_max, float),
            max_retry_after=_number(opts, "max_retry_after", RetryPolicy.max_retry_after, float),
        )
        timeouts = HubTimeouts(
            read=_number(opts, "timeout", HubTimeouts.read, float),
            connect=_number(opts, "connect_timeout", HubTimeouts.connect, float),
        )
        return cls(
            target.repo_id,
            revision=target.revision,
            token=opts.get("token"),
            endpoint=opts.get("endpoint"),
            private=_as_bool("private", opts.get("private", True)),
            branch_per_step=_as_bool("branch_per_step", opts.get("branch_per_step", False)),
            retry=retry,
            hash_threads=_number(opts, "hash_threads", 2, int),
            num_threads=_number(opts, "num_threads", 5, int),
            timeouts=timeouts,
        )

    def __repr__(self) -> str:
        e = urlsplit(self._api.endpoint)
        host = (e.hostname or "") + (f":{e.port}" if e.port else "")  # no user:password@
        return f"HubSink({self.url!r}, endpoint={e._replace(netloc=host).geturl()!r})"

    # --- Sink protocol ----------------------------------------------------------------------------------

    def publish(
        self,
        export_dir: Path,
        step: int,
        *,
        metadata: Mapping[str, Any] | None = None,
        progress: ProgressFn | None = None,
    ) -> PublishResult:
        """Commit `export_dir` as `step` (or find it already there), verify the tree, tag `step-N`.

        `metadata` feeds the model card: `dtype` and `base_model` by name, every other key as run
        metadata. Progress is coarse: (0, total) before the upload and (total, total) after the commit.
        """
        if not isinstance(step, int) or step < 0:
            raise ConfigError(f"step must be a non-negative integer, got {step!r}")
        t0 = time.monotonic()
        export_dir = Path(export_dir)
        local = scan_export(export_dir, threads=self._hash_threads)
        card_bytes = None
        if CARD_NAME not in {f.path for f in local}:
            card_bytes = self._render_card(export_dir, local, step, dict(metadata or {})).encode()
        total = sum(f.size for f in local) + len(card_bytes or b"")
        if progress is not None:
            progress(0, total)
        outcome = self._with_retries(step, lambda: self._publish_once(export_dir, local, card_bytes, step))
        if progress is not None:
            progress(total, total)
        result = PublishResult(
            sink=self.url,
            step=step,
            location=f"{self._api.endpoint}/{self.repo_id}/commit/{outcome.commit}",
            files=len(local) + (card_bytes is not None),
            bytes_total=total,
            bytes_uploaded=outcome.uploaded,
            skipped=outcome.skipped,
            seconds=time.monotonic() - t0,
        )
        log.info(
            "%s: step %d %s at commit %s",
            self.url,
            step,
            "already published" if outcome.skipped else "published",
            outcome.commit,
            extra={"sink": self.url, "step": step, "commit": outcome.commit, "bytes": total},
        )
        return result

    def is_published(self, step: int) -> bool:
        """True when the repo has the tag `step-N` (set only after a verified commit)."""
        from huggingface_hub.errors import RepositoryNotFoundError

        def check() -> bool:
            try:
                refs = self._api.list_repo_refs(self.repo_id)
            except RepositoryNotFoundError as e:
                if e.response is not None and e.response.status_code == 404:
                    return False
                raise
            return step_tag(step) in {t.name for t in refs.tags}

        return self._with_retries(step, check)

    def close(self) -> None:
        """Drop this sink's request bound; huggingface_hub's shared HTTP client is closed at exit."""
        unregister_timeouts(self)

    # --- one attempt ------------------------------------------------------------------------------------

    def _publish_once(
        self, export_dir: Path, local: list[LocalFile], card_bytes: bytes | None, step: int
    ) -> _Outcome:
        self._ensure_repo()
        card = _card_file(card_bytes)
        refs = self._api.list_repo_refs(self.repo_id)
        tags = {t.name: t.target_commit for t in refs.tags}
        branches = {b.name: b.target_commit for b in refs.branches}

        if step_tag(step) in tags:
            self._verify(step, tags[step_tag(step)], local, card, existing=True)
            return _Outcome(tags[step_tag(step)], skipped=True, uploaded=0)

        head_step, found = self._search_commits(step, branches)
        if found is not None:
            log.info("%s: step %d was committed as %s but not tagged; tagging it", self.url, step, found)
            self._verify(step, found, local, card, existing=True)
            self._tag(step, found)
            return _Outcome(found, skipped=True, uploaded=0)

        branch, parent = self._target(step, branches, head_step)
        plan = plan_commit(local, card, self._tree(parent))
        size = sum(f.size for f in local) + (card.size if card else 0)
        info = self._api.create_commit(
            self.repo_id,
            self._operations(export_dir, local, card_bytes, plan),
            commit_message=commit_message(step),
            commit_description=f"{len(plan.adds)} files, {size} bytes, published by stagerd.",
            revision=branch,
            parent_commit=parent,
            num_threads=self._num_threads,
        )
        self._verify(step, info.oid, local, card, existing=False)
        crash_point("hub.commit")
        self._tag(step, info.oid)
        return _Outcome(info.oid, skipped=False, uploaded=plan.new_bytes)

    def _ensure_repo(self) -> None:
        with self._lock:
            if self._repo_ready:
                return
        self._api.create_repo(self.repo_id, private=self.private, exist_ok=True)
        with self._lock:
            self._repo_ready = True

    def _search_commits(self, step: int, branches: Mapping[str, str]) -> tuple[int | None, str | None]:
        """(step of the revision's head commit if stagerd made it, id of a commit titled for `step`)."""
        head_step, found = None, None
        for branch in dict.fromkeys((self.revision, step_branch(step))):
            if branch not in branches:
                continue
            head, hit = scan_history(self._history(branch), step)
            if branch == self.revision:
                head_step = head
            found = found or hit
        return head_step, found

    def _history(self, branch: str) -> Iterator[tuple[str, str]]:
        """(commit id, title) of `branch`, newest first; each page is requested only when it is reached.

        `list_repo_commits` would fetch the whole history first; this is the same endpoint and protocol
        (`limit`, then the `Link` header's next page) through the library's own lazy `paginate`.
        """
        from huggingface_hub.utils import build_hf_headers, paginate

        url = f"{self._api.endpoint}/api/models/{self.repo_id}/commits/{quote(branch, safe='')}"
        headers = build_hf_headers(token=self._token, library_name="stagerd")
        for item in paginate(url, params={"limit": _HISTORY_PAGE}, headers=headers):
            yield item["id"], item["title"]

    def _target(self, step: int, branches: dict[str, str], head_step: int | None) -> tuple[str, str]:
        """(branch to commit to, its head as the parent commit), creating the branch if needed."""
        if self.revision not in branches:
            self._api.create_branch(
                self.repo_id, branch=self.revision, revision=branches["main"], exist_ok=True
            )
            branches[self.revision] = self._branch_head(self.revision)
        if not self.branch_per_step and (head_step is None or head_step < step):
            return self.revision, branches[self.revision]
        if not self.branch_per_step:
            log.warning(
                "%s: %s already holds step %d; step %d goes to branch %s",
                self.url,
                self.revision,
                head_step,
                step,
                step_branch(step),
            )
        branch = step_branch(step)
        if branch not in branches:
            self._api.create_branch(
                self.repo_id, branch=branch, revision=branches[self.revision], exist_ok=True
            )
            branches[branch] = self._branch_head(branch)
        return branch, branches[branch]

    def _branch_head(self, branch: str) -> str:
        refs = self._api.list_repo_refs(self.repo_id)
        return next(b.target_commit for b in refs.branches if b.name == branch)

    def _tree(self, commit: str) -> dict[str, RemoteFile]:
        from huggingface_hub.hf_api import RepoFile

        out = {}
        for f in self._api.list_repo_tree(self.repo_id, recursive=True, revision=commit):
            if isinstance(f, RepoFile):
                out[f.path] = RemoteFile(f.path, f.size, f.blob_id, f.lfs.sha256 if f.lfs else None)
        return out

    def _operations(
        self, export_dir: Path, local: list[LocalFile], card_bytes: bytes | None, plan: CommitPlan
    ) -> list[Any]:
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete

        ops: list[Any] = []
        for f in local:
            op = CommitOperationAdd(path_in_repo=f.path, path_or_fileobj=str(export_dir / f.path))
            op.upload_info.sha256 = bytes.fromhex(f.sha256)  # hashed once already, in scan_export
            ops.append(op)
        if card_bytes is not None:
            ops.append(CommitOperationAdd(path_in_repo=CARD_NAME, path_or_fileobj=card_bytes))
        ops += [CommitOperationDelete(path_in_repo=p, is_folder=False) for p in plan.deletes]
        return ops

    def _verify(
        self, step: int, commit: str, local: list[LocalFile], card: LocalFile | None, *, existing: bool
    ) -> None:
        problems = compare_tree(local, card, self._tree(commit), card_exact=not existing)
        if not problems:
            return
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        if existing:
            raise SinkConflictError(
                f"{self.url}: step {step}: the Hub already holds step {step} at commit {commit}, "
                f"with different content: {shown}"
            )
        raise SinkError(
            f"{self.url}: step {step}: the tree at commit {commit} disagrees with the export: {shown}"
        )

    def _tag(self, step: int, commit: str) -> None:
        self._api.create_tag(
            self.repo_id, tag=step_tag(step), revision=commit, tag_message=commit_message(step), exist_ok=True
        )

    def _render_card(
        self, export_dir: Path, local: list[LocalFile], step: int, metadata: dict[str, Any]
    ) -> str:
        dtype = metadata.pop("dtype", None)
        if dtype is None:
            try:
                dtype = ", ".join(export_dtypes(export_dir, [f.path for f in local])) or None
            except Exception as e:  # safetensors raises its own error type for a corrupt header
                raise VerifyError(
                    f"cannot read the safetensors headers of the export: {e}", path=export_dir
                ) from e
        info = CardInfo(
            repo_id=self.repo_id,
            step=step,
            files=[(f.path, f.size) for f in local],
            dtype=str(dtype) if dtype is not None else None,
            base_model=metadata.pop("base_model", None),
            metadata=metadata,
        )
        return render_model_card(info)

    # --- retries ----------------------------------------------------------------------------------------

    def _redact(self, text: str) -> str:
        if self._token:
            text = text.replace(self._token, "***")
        return _TOKEN_RE.sub("***", text)

    def _with_retries(self, step: int, fn: Callable[[], T]) -> T:
        attempt = 0
        while True:
            attempt += 1
            try:
                return fn()
            except StagerdError:
                raise
            except Exception as exc:
                failure = classify(exc)
                text = self._redact(failure.text)
                where = f"{self.url}: step {step}"
                if failure.kind == "auth":
                    raise SinkAuthError(
                        f"{where}: the Hub refused the request ({text})",
                        hint=f"check HF_TOKEN (or `hf auth login`) and that the token can write to "
                        f"{self.repo_id}; a repo the token cannot see answers 404",
                    ) from None
                if failure.kind == "fatal":
                    raise SinkError(f"{where}: {text}") from None
                if attempt >= self.retry.max_attempts:
                    raise SinkError(f"{where}: gave up after {attempt} attempts: {text}") from None
                delay = failure.retry_after if failure.retry_after is not None else self.retry.delay(attempt)
                if delay > self.retry.max_retry_after:
                    raise SinkError(f"{where}: rate limited for {delay:.0f} s: {text}") from None
                log.warning(
                    "%s: attempt %d/%d failed (%s); retrying in %.2f s",
                    where,
                    attempt,
                    self.retry.max_attempts,
                    text,
                    delay,
                    extra={"sink": self.url, "step": step, "attempt": attempt},
                )
                time.sleep(delay)


def _card_file(card_bytes: bytes | None) -> LocalFile | None:
    if card_bytes is None:
        return None
    git = hashlib.sha1(b"blob %d\0" % len(card_bytes) + card_bytes).hexdigest()
    return LocalFile(CARD_NAME, len(card_bytes), hashlib.sha256(card_bytes).hexdigest(), git)
