"""A Hub sink's refs in its repo: the tag that marks a published step and the branch a step is committed
to, each trusted or moved only once it is found to be the sink's own (see the package docstring)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from stagerd.errors import SinkConflictError
from stagerd.sinks.hub.authors import committed_by
from stagerd.sinks.hub.history import Pages, Scan, find_step, holds_only, tag_title_is_ours
from stagerd.sinks.hub.url import (
    _HISTORY_PAGE,
    DEFAULT_REVISION,
    commit_message,
    step_branch,
    step_tag,
)

if TYPE_CHECKING:
    from huggingface_hub import HfApi

log = logging.getLogger("stagerd.sinks.hub")


@dataclass(frozen=True)
class StepRefs:
    """The refs of `repo_id` that a sink on `revision` reads and sets; `url` names the sink in messages,
    `history` reads a branch's commits newest first, and no walk of it goes past `cap` commits."""

    api: HfApi
    repo_id: str
    revision: str
    branch_per_step: bool
    url: str
    history: Pages
    cap: int

    def tag_name(self, step: int) -> str:
        return step_tag(step, self.revision)

    def step_branch(self, step: int) -> str:
        return step_branch(step, self.revision)

    def search(self, step: int, branches: Mapping[str, str]) -> Scan:
        """The revision's newest step and this sink's commit of `step`, read only from this sink's branches
        (its revision and its step branch) and its own commit titles (`history.py`)."""
        return find_step(self.history, step, self.revision, branches, cap=self.cap, page=_HISTORY_PAGE)

    def tag_is_ours(self, step: int, tagged: str, scan: Scan) -> bool:
        """Whether this sink's tag of `step` marks its own commit of the step: the one the walk found, or,
        where the walk ended at the cap without an answer, a commit titled for the step (the tag's)."""
        if scan.found is not None or not scan.capped:
            return tagged == scan.found
        return tag_title_is_ours(self.history, tagged, step, self.revision)

    def target(self, step: int, branches: dict[str, str], head_step: int | None) -> tuple[str, str]:
        """(branch to commit to, its head as the parent commit), creating the branch if needed."""
        onto_revision = not self.branch_per_step and (head_step is None or head_step < step)
        self._check_branch_names(step, branches, step_branch=not onto_revision)
        if self.revision not in branches:
            self.api.create_branch(
                self.repo_id, branch=self.revision, revision=branches["main"], exist_ok=True
            )
            branches[self.revision] = self._branch_head(self.revision)
        if onto_revision:
            return self.revision, branches[self.revision]
        if not self.branch_per_step:
            log.warning(
                "%s: %s already holds step %d; step %d goes to branch %s",
                self.url,
                self.revision,
                head_step,
                step,
                self.step_branch(step),
            )
        branch = self.step_branch(step)
        if branch in branches:
            self._check_own_branch(step, branch, branches[branch])
        elif self._create_branch(branch, branches[self.revision]):
            branches[branch] = self._branch_head(branch)
        else:  # the Hub's 409: someone made it since the refs were read; its head is checked and committed on
            branches[branch] = self._branch_head(branch)
            self._check_own_branch(step, branch, branches[branch])
        return branch, branches[branch]

    def check_names(self, step: int, tags: Mapping[str, str], branches: Mapping[str, str]) -> None:
        """Refuse, before anything is written, a revision that is a tag (a branch made beside it would make
        the name mean two refs to every reader, `revision=` and `restore @R`), the step's tag where a branch
        has its name (the same, the other way), and a tag that keeps the step's tag from being made: git
        keeps refs as paths, so `a` and `a/b` cannot both be tags."""
        tag = self.tag_name(step)
        if tag not in tags and tag in branches:
            what = f"step {step}: the branch {tag} of {self.repo_id} has the name of the step's tag"
            hint = (
                f"rename the branch {tag} (the Hub reads a name that is a branch and a tag as the branch, "
                f"so revision={tag} would not be step {step})"
            )
        elif self.revision != DEFAULT_REVISION and self.revision in tags:
            what = f"the revision {self.revision} is a tag of {self.repo_id}, not a branch"
            hint = (
                f"publish to a branch (hf://{self.repo_id}@BRANCH, made if missing); read the tag with "
                f"`stagerd restore hf://{self.repo_id}@{self.revision} OUT --export`"
            )
        else:
            nested = _blocking(tag, tags)
            if nested is None:
                return
            what = (
                f"step {step}: the tag {nested} of {self.repo_id} keeps the step's tag {tag} from being made"
            )
            hint = f"rename the tag {nested} (a tag and a folder of tags cannot share a name)"
        raise SinkConflictError(f"{what}; nothing was written", path=self.url, hint=hint)

    def _check_branch_names(self, step: int, branches: Mapping[str, str], *, step_branch: bool) -> None:
        """Refuse, before any branch is made, a branch this publish must make (the revision, if missing; the
        step's branch, where `step_branch`) that a person's branch keeps from being made: git keeps refs as
        paths, so a branch `stagerd` leaves no room for `stagerd/step-N` (the Hub's answer was a bare 400,
        retried, after the revision's branch was made)."""
        wanted = [self.revision] if self.revision not in branches else []
        if step_branch and self.step_branch(step) not in branches:
            wanted.append(self.step_branch(step))
        for name in wanted:
            nested = _blocking(name, branches)
            if nested is None:
                continue
            if name == self.revision:
                hint = f"rename the branch {nested} of {self.repo_id}, or publish to another revision"
            else:
                hint = (
                    f"rename the branch {nested} of {self.repo_id} (stagerd's step branches are "
                    f"stagerd/...), or publish without branch_per_step: steps in order then go onto "
                    f"{self.revision} and need no step branch"
                )
            raise SinkConflictError(
                f"step {step}: the branch {nested} of {self.repo_id} keeps the branch {name} from being made "
                "(a branch and a folder of branches cannot share a name); nothing was written",
                path=self.url,
                hint=hint,
            )

    def _create_branch(self, branch: str, start: str) -> bool:
        """Make `branch` from `start`; False where it exists already (the Hub's 409)."""
        from huggingface_hub.errors import HfHubHTTPError

        try:
            self.api.create_branch(self.repo_id, branch=branch, revision=start)
        except HfHubHTTPError as e:
            if e.response is None or e.response.status_code != 409:
                raise
            return False
        return True

    def _check_own_branch(self, step: int, branch: str, head: str) -> None:
        if holds_only(self.history, head, self.revision, cap=self.cap, page=_HISTORY_PAGE):
            return
        who = committed_by(self.api, self.repo_id, head)
        newest = f"; its head {head} is by {who}" if who else ""
        raise SinkConflictError(
            f"step {step}: the branch {branch} holds commits that are not on {self.revision} "
            f"(made by hand, or by an older stagerd for another revision{newest}); nothing was committed",
            path=self.url,
            hint=f"inspect the branch {branch} of {self.repo_id}; rename or delete it (HfApi.delete_branch) "
            f"to let this sink publish step {step} there",
        )

    def _branch_head(self, branch: str) -> str:
        refs = self.api.list_repo_refs(self.repo_id)
        return next(b.target_commit for b in refs.branches if b.name == branch)

    def foreign_tag(self, step: int, commit: str) -> SinkConflictError:
        """The error for this sink's tag of `step` marking a commit that is not its commit of the step."""
        tag = self.tag_name(step)
        where = " or ".join(dict.fromkeys((self.revision, self.step_branch(step))))
        who = committed_by(self.api, self.repo_id, commit)
        by = f" ({who})" if who else ""
        return SinkConflictError(
            f"step {step}: the tag {tag} marks commit {commit}{by}, which is not a "
            f"'{commit_message(step, self.revision)}' commit of {where}",
            path=self.url,
            hint=f"the tag {tag} of {self.repo_id} was not set by a publish to {self.revision}: inspect it, "
            f"and delete that tag (HfApi.delete_tag) to let this sink publish step {step}",
        )

    def tag(self, step: int, commit: str) -> None:
        """Tag `commit` as the step; a tag someone set meanwhile counts only where it marks `commit` too."""
        from huggingface_hub.errors import HfHubHTTPError

        tag = self.tag_name(step)
        try:
            self.api.create_tag(
                self.repo_id, tag=tag, revision=commit, tag_message=commit_message(step, self.revision)
            )
        except HfHubHTTPError as e:
            if e.response is None or e.response.status_code != 409:
                raise
            marked = {t.name: t.target_commit for t in self.api.list_repo_refs(self.repo_id).tags}.get(tag)
            if marked != commit:
                raise self.foreign_tag(step, str(marked)) from None


def _blocking(name: str, refs: Mapping[str, str]) -> str | None:
    """The ref among `refs` that keeps `name` from being made beside it (`a` against `a/b`, either way):
    git keeps refs as paths, so a ref and a folder of refs cannot share a name."""
    return next((r for r in sorted(refs) if r.startswith(f"{name}/") or name.startswith(f"{r}/")), None)
