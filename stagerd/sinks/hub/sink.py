"""`HubSink`: one publish is one `create_commit` and one tag; see the package docstring for the rules."""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from stagerd.errors import (
    ConfigError,
    SinkConflictError,
    SinkError,
)
from stagerd.ops.crashpoints import crash_point
from stagerd.sinks.base import ProgressFn, PublishResult
from stagerd.sinks.hub.authors import committed_by
from stagerd.sinks.hub.client import hub_api, hub_headers
from stagerd.sinks.hub.errors import refuse_offline
from stagerd.sinks.hub.history import commit_pages
from stagerd.sinks.hub.model_card import CARD_NAME, card_for_export
from stagerd.sinks.hub.options import sink_arguments
from stagerd.sinks.hub.refs import StepRefs
from stagerd.sinks.hub.retries import redact, with_retries
from stagerd.sinks.hub.timeouts import HubTimeouts, register_timeouts, unregister_timeouts
from stagerd.sinks.hub.tree import (
    HubFile,
    RemoteFile,
    compare_tree,
    is_adapter,
    left_beside,
    plan_commit,
    scan_export,
)
from stagerd.sinks.hub.upload import (
    ask_upload_modes,
    commit_operations,
    send_additions,
    unchanged_operation,
)
from stagerd.sinks.hub.url import (
    _HISTORY_CAP,
    _HISTORY_PAGE,
    HubTarget,
    RetryPolicy,
    T,
    check_publish_revision,
    commit_message,
    step_tag,
)
from stagerd.sinks.hub.xet import XetUploader
from stagerd.sinks.urls import shown as url_shown

log = logging.getLogger("stagerd.sinks.hub")


@dataclass(frozen=True)
class _Outcome:
    commit: str
    skipped: bool
    uploaded: int


class HubSink:
    """Publishes exports to one Hub repo. Thread-safe; see the module docstring for the protocol."""

    history_cap = _HISTORY_CAP  # commits read at most per branch and publish

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
        from huggingface_hub import get_token

        check_publish_revision(repo_id, revision)
        refuse_offline(HubTarget(repo_id, revision, {}).redacted)
        self.repo_id = repo_id
        self.revision = revision or "main"
        self.private = private
        self.branch_per_step = branch_per_step
        self.retry = retry or RetryPolicy()
        self.url = HubTarget(repo_id, revision, {}).redacted
        self._token = token or get_token()
        self._api = hub_api(endpoint, self._token)
        self.timeouts = timeouts or HubTimeouts()
        register_timeouts(self, self._api.endpoint, self.timeouts)
        self._xet = XetUploader(self.timeouts)
        self._hash_threads = hash_threads
        self._num_threads = num_threads
        self._repo_ready = False
        self._lock = threading.Lock()
        self._refs = StepRefs(
            self._api, repo_id, self.revision, branch_per_step, self.url, self._history, self.history_cap
        )

    @classmethod
    def from_url(cls, url: str, **options: Any) -> HubSink:
        """Build a sink from `hf://ORG/REPO[@REVISION][?opts]`; keyword options override the query."""
        repo_id, arguments = sink_arguments(url, options)
        return cls(repo_id, **arguments)

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
        """Commit `export_dir` as `step` (or find it already there), verify the tree, tag it (`step-N`,
        or `REVISION/step-N` off main).

        `metadata` feeds the model card: `dtype` and `base_model` by name, every other key as run
        metadata. Progress counts files the parent commit already holds as done, then the bytes hf_xet
        has processed; (total, total) after the commit. `bytes_uploaded` is what went over the wire.
        """
        if not isinstance(step, int) or step < 0:
            raise ConfigError(f"step must be a non-negative integer, got {step!r}")
        t0 = time.monotonic()
        export_dir = Path(export_dir)
        local = scan_export(export_dir, threads=self._hash_threads)
        card_bytes = None
        if CARD_NAME not in {f.path for f in local}:
            files = [(f.path, f.size) for f in local]
            card = card_for_export(
                export_dir, self.repo_id, files, step, dict(metadata or {}), self._refs.tag_name(step)
            )
            # the card is public: run metadata may hold a token (`vars(args)` with a `hub_token`, a command)
            card_bytes = redact(card, self._token).encode()
        total = sum(f.size for f in local) + len(card_bytes or b"")
        if progress is not None:
            progress(0, total)
        outcome = self._with_retries(
            step, lambda: self._publish_once(export_dir, local, card_bytes, step, progress, total)
        )
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
        """True when the repo has this sink's tag for `step` (set only after a verified commit) and it marks
        this sink's own commit of the step: a tag that marks anything else is not this sink's step."""
        from huggingface_hub.errors import RepositoryNotFoundError

        def check() -> bool:
            try:
                refs = self._api.list_repo_refs(self.repo_id)
            except RepositoryNotFoundError as e:
                if e.response is not None and e.response.status_code == 404:
                    return False
                raise
            tags = {t.name: t.target_commit for t in refs.tags}
            tagged = tags.get(self._refs.tag_name(step))
            scan = self._refs.search(step, {b.name: b.target_commit for b in refs.branches})
            if tagged is None:  # an older stagerd's step on this revision: its unscoped tag marks it
                return scan.legacy and tags.get(step_tag(step)) == scan.found
            return self._refs.tag_is_ours(step, tagged, scan)

        return self._with_retries(step, check)

    def close(self) -> None:
        """Drop this sink's request bound and Xet session; huggingface_hub's shared HTTP client is closed
        at exit."""
        unregister_timeouts(self)
        self._xet.close()

    # --- one attempt ------------------------------------------------------------------------------------

    def _publish_once(
        self,
        export_dir: Path,
        local: list[HubFile],
        card_bytes: bytes | None,
        step: int,
        progress: ProgressFn | None,
        total: int,
    ) -> _Outcome:
        self._ensure_repo()
        card = _card_file(card_bytes)
        refs = self._api.list_repo_refs(self.repo_id)
        tags = {t.name: t.target_commit for t in refs.tags}
        branches = {b.name: b.target_commit for b in refs.branches}
        self._refs.check_names(step, tags, branches)

        head_step, found, capped, legacy = scan = self._refs.search(step, branches)
        tagged = tags.get(self._refs.tag_name(step))
        if tagged is not None:
            if not self._refs.tag_is_ours(step, tagged, scan):
                raise self._refs.foreign_tag(step, tagged)
            self._verify(step, tagged, local, card, existing=True)
            return _Outcome(tagged, skipped=True, uploaded=0)
        if found is not None:
            how = "published by an older stagerd (unscoped names)" if legacy else "committed"
            tag = self._refs.tag_name(step)
            log.info("%s: step %d was %s as %s, not tagged %s; tagging it", self.url, step, how, found, tag)
            self._verify(step, found, local, card, existing=True)
            self._refs.tag(step, found)
            return _Outcome(found, skipped=True, uploaded=0)

        if capped:
            log.warning(
                "%s: step %d: no commit for it in the newest %d commits; taking it as not committed",
                self.url,
                step,
                self.history_cap,
            )
        branch, parent = self._refs.target(step, branches, head_step)
        tree = self._tree(parent)
        theirs = tree.get(card.path) if card is not None else None
        if theirs is not None and left_beside(theirs, adapter=is_adapter(local)):
            card = card_bytes = None  # a model card a person wrote on the branch is theirs to keep
        plan = plan_commit(local, card, tree)
        if plan.beside:
            log.info("%s: step %d: left as they are: %s", self.url, step, ", ".join(plan.beside))
        size = sum(f.size for f in local) + (card.size if card else 0)
        files = len(local) + (card is not None)
        additions, deletes = commit_operations(export_dir, local, card_bytes, plan)
        where = f"{url_shown(self.url)}: step {step}"
        ask_upload_modes(self._api, self.repo_id, branch, additions, self._headers(), where=where)
        done = total - plan.new_bytes  # what the parent holds already
        sent = send_additions(
            self._api,
            self.repo_id,
            branch,
            additions,
            uploader=self._xet,
            headers=self._headers(),
            progress=None if progress is None else lambda n: progress(min(total, done + n), total),
        )
        if not additions and not deletes:
            additions = [
                unchanged_operation(
                    self._api, self.repo_id, branch, export_dir, local, card_bytes, self._headers()
                )
            ]
        info = self._api.create_commit(
            self.repo_id,
            [*additions, *deletes],
            commit_message=commit_message(step, self.revision),
            commit_description=f"{files} files, {size} bytes, published by stagerd.",
            revision=branch,
            parent_commit=parent,
            num_threads=self._num_threads,
        )
        self._verify(step, info.oid, local, card, existing=False)
        crash_point("hub.commit")
        self._refs.tag(step, info.oid)
        log.debug(
            "%s: step %d: %d files sent (%d bytes over the wire, %s), %d kept from the parent commit",
            self.url,
            step,
            len(plan.adds),
            sent.bytes,
            sent.via,
            len(plan.kept),
        )
        return _Outcome(info.oid, skipped=False, uploaded=sent.bytes)

    def _ensure_repo(self) -> None:
        with self._lock:
            if self._repo_ready:
                return
        self._api.create_repo(self.repo_id, private=self.private, exist_ok=True)
        with self._lock:
            self._repo_ready = True

    def _history(self, branch: str, page: int = _HISTORY_PAGE) -> Iterator[tuple[str, str]]:
        """(commit id, title) of `branch` (or a commit), newest first, each page read when reached."""
        return commit_pages(self._api.endpoint, self.repo_id, self._headers())(branch, page)

    def _headers(self) -> dict[str, str]:
        return hub_headers(self._token)

    def _tree(self, commit: str) -> dict[str, RemoteFile]:
        from huggingface_hub.hf_api import RepoFile

        out = {}
        # expanded: each file's last commit tells a file stagerd wrote from one a person added
        for f in self._api.list_repo_tree(self.repo_id, recursive=True, revision=commit, expand=True):
            if isinstance(f, RepoFile):
                title = f.last_commit.title if f.last_commit else None
                out[f.path] = RemoteFile(f.path, f.size, f.blob_id, f.lfs.sha256 if f.lfs else None, title)
        return out

    def _verify(
        self, step: int, commit: str, local: list[HubFile], card: HubFile | None, *, existing: bool
    ) -> None:
        problems = compare_tree(local, card, self._tree(commit), card_exact=not existing)
        if not problems:
            return
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        if existing:
            who = committed_by(self._api, self.repo_id, commit)
            by = f", published by another run ({who})" if who else ""
            raise SinkConflictError(
                f"{url_shown(self.url)}: step {step}: the Hub already holds step {step} at commit "
                f"{commit}{by}, with different content: {shown}",
                hint=f"another run publishes to {self.repo_id} on {self.revision}: give each run its own "
                f"repo or revision (hf://{self.repo_id}@BRANCH); the step there is another upload, so "
                "inspect its commit before deleting anything",
            )
        raise SinkError(
            f"{url_shown(self.url)}: step {step}: the tree at commit {commit} disagrees with the export: "
            f"{shown}"
        )

    # --- retries ----------------------------------------------------------------------------------------

    def _with_retries(self, step: int, fn: Callable[[], T]) -> T:
        return with_retries(fn, self.retry, sink=self.url, step=step, repo_id=self.repo_id, token=self._token)


def _card_file(card_bytes: bytes | None) -> HubFile | None:
    if card_bytes is None:
        return None
    git = hashlib.sha1(b"blob %d\0" % len(card_bytes) + card_bytes).hexdigest()
    return HubFile(CARD_NAME, len(card_bytes), hashlib.sha256(card_bytes).hexdigest(), git)
