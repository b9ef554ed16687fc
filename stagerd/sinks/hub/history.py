"""Which commit of a branch's history is a sink's commit of step N, read newest first without reading it all.

A commit is this sink's when its title is this revision's title for the step (`url.py`). Two kinds of
history are not the sink's own: the history a branch was created from (main's steps, under main's titles),
and anything older than `cap` commits, which is never read. Two answers reach past the walk:

- a tag whose commit lies beyond the cap is this sink's when that commit's own title is this revision's
  title for the step (one request: `tag_title_is_ours`);
- on a revision R other than main, an older stagerd titled its steps `stagerd: step N` (unscoped, as on
  main). Such a commit on R's branch is R's own when it is newer than where R's history meets main's
  (`above_fork`): a branch made from main holds main's `stagerd: step N` commits too, and those are main's
  steps, never R's. Every other branch a person made (not `stagerd/...`) is checked alike, since R may
  have been made from one an older stagerd published to. A meeting point must be seen within the cap: after
  main's history is squashed, or where another branch holds the commit too, it is not R's, loudly.
  That stagerd's step branch off R was `stagerd/step-N`, the name main's step branches have: its
  `stagerd: step N` is R's when the branch was made from one of R's own commits (as above), since main's
  are made from main's head; so, for main, a commit on `stagerd/step-N` is main's only when the commit
  under it is in main's history (`made_from`), not above where the branch meets main.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from itertools import islice
from typing import NamedTuple
from urllib.parse import quote

from stagerd.sinks.hub.url import (
    _HISTORY_CAP,
    _HISTORY_PAGE,
    DEFAULT_REVISION,
    commit_message,
    revision_scope,
    step_branch,
    step_tag,
    title_step,
)

log = logging.getLogger("stagerd.sinks.hub")

# (commit id or ref, page size) -> (commit id, title) pairs of its history, newest first, read lazily
Pages = Callable[[str, int], Iterator[tuple[str, str]]]


def commit_pages(endpoint: str, repo_id: str, headers: Mapping[str, str]) -> Pages:
    """A repo's `Pages`: each page is requested only when it is reached.

    `list_repo_commits` would fetch the whole history first; this is the same endpoint and protocol
    (`limit`, then the `Link` header's next page) through the library's own lazy `paginate`.
    """

    def pages(rev: str, page: int) -> Iterator[tuple[str, str]]:
        from huggingface_hub.utils import paginate

        url = f"{endpoint}/api/models/{repo_id}/commits/{quote(rev, safe='')}"
        for item in paginate(url, params={"limit": page}, headers=dict(headers)):
            yield item["id"], item["title"]

    return pages


class Scan(NamedTuple):
    """What a history walk found for one step."""

    head_step: int | None  # the step of the newest commit stagerd made for the revision
    found: str | None  # the id of the revision's commit titled for the step
    capped: bool = False  # `cap` commits read without an answer: the step's commit may be older
    legacy: bool = False  # `found` is an older stagerd's unscoped `stagerd: step N` made on the revision


def scan_history(
    commits: Iterable[tuple[str, str]],
    step: int,
    *,
    revision: str | None = None,
    cap: int = _HISTORY_CAP,
    own_unscoped: Callable[[str, int], bool] | None = None,
) -> Scan:
    """Find `step`'s commit for `revision` in (id, title) pairs, newest first.

    The newest stagerd commit counts, not only the head: a person's commit on top of step 50 (a card
    edited on the Hub) must not let step 40 onto the branch over step 50's weights. Reading stops at the
    sought commit, at a stagerd commit of an earlier step (stagerd commits a branch's steps in increasing
    order, so the sought one cannot be older), at a stagerd commit for another revision (the history this
    branch was created from: main's step N is not this revision's), or after `cap` commits (`capped`).
    Off main, an unscoped `stagerd: step K` commit counts as the revision's own (`legacy`) only where
    `own_unscoped(id, K)` says an older stagerd made it on this revision.
    """
    scope = revision_scope(revision)
    head_step: int | None = None
    read = 0
    for oid, title in islice(commits, cap):
        read += 1
        found = title_step(title)
        legacy = False
        if found is not None and found[1] != scope:
            if found[1] is not None or own_unscoped is None or not own_unscoped(oid, found[0]):
                return Scan(head_step, None)
            legacy = True
        seen = None if found is None else found[0]
        if head_step is None:
            head_step = seen
        if seen == step:
            return Scan(head_step, oid, legacy=legacy)
        if seen is not None and seen < step:
            return Scan(head_step, None)
    return Scan(head_step, None, capped=read == cap)


def above_fork(
    branch: Iterable[tuple[str, str]], other: Iterable[tuple[str, str]], cap: int = _HISTORY_CAP
) -> set[str] | None:
    """The commits of `branch` newer than where its history meets `other`'s (the newest commit both hold),
    from (id, title) pairs newest first, both read in step and only until they meet; None when the newest
    `cap` commits of each do not meet (a squashed main, or one far ahead)."""
    walks = (iter(islice(branch, cap)), iter(islice(other, cap)))
    seen: tuple[set[str], set[str]] = (set(), set())
    read: list[str] = []  # the branch's, in order
    live, met = [True, True], False
    while not met and any(live):
        for side in (0, 1):
            item = next(walks[side], None) if live[side] else None
            if item is None:
                live[side] = False
                continue
            seen[side].add(item[0])
            if side == 0:
                read.append(item[0])
            if item[0] in seen[1 - side]:
                met = True
                break
    if not met:
        return None
    fork = next(i for i, oid in enumerate(read) if oid in seen[1])
    return set(read[:fork])


def find_step(
    pages: Pages, step: int, revision: str, branches: Mapping[str, str], *, cap: int, page: int
) -> Scan:
    """The step's commit on the sink's own branches (its revision, its step branch), and the revision's
    newest step. `capped` only when no branch answered and one walk ended at the cap."""
    forks: dict[str, set[str] | None] = {}  # branch -> the revision's commits above where they meet

    def fork(other: str) -> set[str] | None:
        if other not in forks:
            forks[other] = above_fork(pages(revision, page), pages(other, page), cap)
        return forks[other]

    def shared_with(oid: str) -> list[str] | None:
        """The other branches `oid` (a commit of the revision) may be theirs too; None for main's."""
        if DEFAULT_REVISION in branches:  # the common case ends here, quietly, reading main alone
            main_above = fork(DEFAULT_REVISION)
            if main_above is not None and oid not in main_above:
                return None  # main's: at or below where the revision left main
        others = [b for b in branches if b != revision and not b.startswith("stagerd/")]
        if not others:
            return None
        return [b for b in others if (above := fork(b)) is None or oid not in above]

    def own_unscoped(oid: str, k: int) -> bool:
        shared = shared_with(oid)
        if shared:
            log.warning(
                "%s holds the commit %s titled 'stagerd: step %d' (an older stagerd's name for step %d on "
                "any branch), and its newest %d commits do not show it is %s's own rather than %s's: taking "
                "it as not %s's. If an older stagerd published it to %s, tag it %s (HfApi.create_tag)",
                revision,
                oid,
                k,
                k,
                cap,
                revision,
                " or ".join(shared),
                revision,
                revision,
                step_tag(k, revision),
            )
        return shared is not None and not shared

    def own_old_branch(oid: str, k: int) -> bool:
        """An older stagerd's step branch `stagerd/step-N` (main's step branches have that name too) holds
        the revision's step when it was made from one of the revision's own commits: main's are made from
        main's head, which is never the revision's own."""
        if k != step:
            return False
        branch = step_branch(k)
        above = above_fork(pages(branch, page), pages(revision, page), cap)
        if above is None:
            return False
        base = next((c for c, _ in islice(pages(branch, page), cap) if c not in above), None)
        return base is not None and shared_with(base) == []

    head_step, found, capped, legacy = None, None, False, False
    for branch in dict.fromkeys((revision, step_branch(step, revision))):
        if branch not in branches:
            continue
        judge = own_unscoped if branch == revision and revision_scope(revision) else None
        scan = scan_history(pages(branch, page), step, revision=revision, cap=cap, own_unscoped=judge)
        if branch == revision:
            head_step = scan.head_step
        mains_step_branch = branch != revision and not revision_scope(revision)
        if (
            scan.found is not None
            and mains_step_branch
            and not made_from(pages, branch, scan.found, revision, cap=cap, page=page)
        ):
            scan = scan._replace(found=None)  # an older stagerd's step branch of another revision
        if found is None and scan.found is not None:
            found, legacy = scan.found, scan.legacy
        capped = capped or scan.capped
    old_branch = step_branch(step)
    if found is None and revision_scope(revision) and old_branch in branches:
        scan = scan_history(
            pages(old_branch, page), step, revision=revision, cap=cap, own_unscoped=own_old_branch
        )
        found, legacy = scan.found, scan.found is not None
    return Scan(head_step, found, capped and found is None, legacy)


def made_from(pages: Pages, branch: str, oid: str, revision: str, *, cap: int, page: int) -> bool:
    """Whether the commit under `oid` on the step branch `branch` is in `revision`'s history: a sink makes
    its step branch from its revision's head. An older stagerd gave a revision R's step branches main's
    names (`stagerd/step-N`), made from R's own commits, which lie above where R meets main. Where the
    two histories do not meet within the cap, the branch counts as the revision's (as it always did)."""
    above = above_fork(pages(branch, page), pages(revision, page), cap)
    if above is None:
        return True
    walk = (c for c, _ in islice(pages(branch, page), cap))
    if oid not in walk:
        return True
    parent = next(walk, None)
    return parent is None or parent not in above


def holds_only(pages: Pages, branch: str, revision: str, *, cap: int, page: int) -> bool:
    """Whether the step branch `branch`, holding no commit of its step, holds nothing `revision` does not:
    then it is one the sink made before a crash and may commit onto. A person's commits on it, or an older
    stagerd's for another revision (its step branches had main's names), are never committed over."""
    return above_fork(pages(branch, page), pages(revision, page), cap) == set()


def tag_title_is_ours(pages: Pages, commit: str, step: int, revision: str) -> bool:
    """Whether the commit a tag marks is titled as this revision's commit of `step` (one request). Off main
    the unscoped title counts too: the revision's tag on it was set by a sink on the revision (taking an
    older stagerd's commit), never by main's."""
    titles = {commit_message(step, revision)}
    if revision_scope(revision):
        titles.add(commit_message(step))
    first = next(pages(commit, 1), None)
    return first is not None and first[0] == commit and first[1] in titles


def older_stagerds_step(
    pages: Pages, step: int, revision: str, branches: Mapping[str, str], tags: Mapping[str, str]
) -> str | None:
    """The commit of `step` an older stagerd published on `revision` (off main) under unscoped names, or
    None: an unscoped commit of the revision's own (`find_step`), marked by the older tag `step-N`, which
    that stagerd set only once the commit was verified."""
    if not revision_scope(revision) or step_tag(step, revision) in tags:
        return None
    scan = find_step(pages, step, revision, branches, cap=_HISTORY_CAP, page=_HISTORY_PAGE)
    return scan.found if scan.legacy and tags.get(step_tag(step)) == scan.found else None
