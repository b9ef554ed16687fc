"""The Hub sink's URL (`hf://ORG/REPO[@REVISION][?options]`) and each step's commit, tag and branch."""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import parse_qsl, unquote, urlsplit

from stagerd.contract.layout import MAX_STEP
from stagerd.errors import (
    ConfigError,
)

if TYPE_CHECKING:
    pass


log = logging.getLogger("stagerd.sinks.hub")

T = TypeVar("T")
N = TypeVar("N", int, float)

GITATTRIBUTES = ".gitattributes"
# The Hub stores files above 10 MB in LFS whatever their name; below, a file may be a plain git blob,
# whose tree entry carries only the git blob id, so that id is computed for small files.
_GIT_OID_MAX = 10 * 1024 * 1024
_FORBIDDEN_DIRS = {".git", ".cache", ".huggingface"}
_HASH_CHUNK = 8 << 20
# `stagerd: step N` on the default revision; `stagerd: step N on REVISION` elsewhere (a ref has no spaces)
# ASCII digits as `commit_message` writes them: `\d` took U+0661 for 1, and 5,000 digits were a raw
# ValueError out of int() (a commit title is anyone's with write access to the repo)
_STEP_TITLE = re.compile(r"stagerd: step (0|[1-9][0-9]{0,18})(?: on (\S+))?")
DEFAULT_REVISION = "main"
_HISTORY_PAGE = 50  # commits per request while looking for a step's commit
_HISTORY_CAP = 1000  # commits read at most per branch and publish
# git's `check-ref-format` rules, which the Hub's refs follow; a revision is checked as the prefix of the
# names derived from it (`R/step-N`, `stagerd/R/step-N`), so `/` separates folders of refs
_BAD_REF = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]|\.\.|@\{|//|^/|/$|\.$|(^|/)\.|\.lock(/|$)")


_COMMIT_ID = re.compile(r"[0-9a-fA-F]{40}")
# huggingface_hub's `hf://TYPE/ORG/NAME` prefixes: names the Hub reserves, never a namespace
_TYPE_PREFIXES = ("models", "datasets", "spaces", "kernels", "buckets")


def check_publish_revision(repo_id: str, revision: str | None) -> None:
    """A revision a sink may commit to: a commit id or a full ref name (`refs/pr/1`) names no branch, and
    one made with that name would shadow the commit or ref for everyone who reads it by that name.
    `restore` reads them; only publishing refuses them."""
    if revision is None or not (_COMMIT_ID.fullmatch(revision) or revision.startswith("refs/")):
        return
    what = "a commit id" if _COMMIT_ID.fullmatch(revision) else "a full ref name"
    raise ConfigError(
        f"cannot publish to hf://{repo_id}@{revision}: the revision is {what}, not a branch",
        hint=f"publish to a branch (hf://{repo_id}@BRANCH, made from main if missing); read that revision "
        f"with `stagerd restore hf://{repo_id}@{revision} OUT --export`",
    )


# A sink's steps are scoped to its revision: two runs publishing to two branches of one repo share no tag,
# no step branch and no commit title, so neither can take the other's step for its own. The default revision
# keeps the unscoped names (existing repos, `hf://ORG/REPO@step-N`).


def revision_scope(revision: str | None) -> str | None:
    """None for the default revision, else the revision: what a step's names are scoped to."""
    return None if revision in (None, DEFAULT_REVISION) else revision


def commit_message(step: int, revision: str | None = None) -> str:
    scope = revision_scope(revision)
    return f"stagerd: step {step}" + (f" on {scope}" if scope else "")


def step_tag(step: int, revision: str | None = None) -> str:
    """`step-N` on main, `REVISION/step-N` on another revision (the Hub takes `/` in refs, as git does)."""
    scope = revision_scope(revision)
    return f"{scope}/step-{step}" if scope else f"step-{step}"


def step_branch(step: int, revision: str | None = None) -> str:
    """`stagerd/step-N` from main, `stagerd/REVISION/step-N` from another revision (never under
    `REVISION/`: a branch cannot be both a ref and a folder of refs)."""
    scope = revision_scope(revision)
    return f"stagerd/{scope}/step-{step}" if scope else f"stagerd/step-{step}"


def title_step(title: str) -> tuple[int, str | None] | None:
    """(step, scope) of a commit title stagerd wrote, or None."""
    m = _STEP_TITLE.fullmatch(title)
    if m is None or int(m.group(1)) > MAX_STEP:
        return None
    return int(m.group(1)), m.group(2)


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


def repo_kind_problem(path: str) -> tuple[str, str | None] | None:
    """Why an `hf://` path whose first part names a repo type, as huggingface_hub's own `hf://` form does
    (`hf://datasets/ORG/NAME`, `hf://models/ORG/NAME`), names no model repo, and the URL it may mean; None
    for any other path. The Hub reserves those names, so no repo is in such a namespace: a dataset's short
    form `hf://datasets/NAME` is no model repo `datasets/NAME`."""
    kind, _, rest = path.partition("/")
    if kind not in _TYPE_PREFIXES:
        return None
    if kind == "models":
        whole = rest.count("/") == 1 and all(rest.split("/"))
        return "stagerd's URLs name a model repo without models/", f"hf://{rest}" if whole else None
    return f"the Hub sink publishes to model repos only, not {kind}", None


def parse_hub_url(url: str) -> HubTarget:
    """Split `hf://ORG/REPO[@REVISION][?k=v...]`. A malformed URL is a ConfigError (without the query)."""
    parts = urlsplit(url)
    shown = url.split("?", 1)[0]
    if parts.scheme != "hf":
        raise ConfigError(f"not a Hub sink URL: {shown!r} (expected hf://ORG/REPO[@REVISION])")
    path = (parts.netloc + parts.path).strip("/")
    repo_id, _, revision = path.partition("@")
    if (problem := repo_kind_problem(repo_id)) is not None:
        why, meant = problem
        raise ConfigError(
            f"bad Hub sink URL {shown!r}: {why}",
            hint=f"did you mean {meant}?" if meant else "name a model repo: hf://ORG/REPO[@REVISION]",
        )
    if repo_id.count("/") != 1 or not all(repo_id.split("/")) or (revision == "" and "@" in path):
        raise ConfigError(f"bad Hub sink URL {shown!r}: expected hf://ORG/REPO[@REVISION]")
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise ConfigError(f"bad repo id in {shown!r}: {e}") from None
    if revision and unquote(revision) != revision:  # huggingface_hub's hf:// form encodes a `/` as %2F
        raise ConfigError(
            f"bad Hub sink URL {shown!r}: the revision {revision!r} is percent-encoded, and stagerd takes "
            "a revision as written",
            hint=f"write it unencoded: hf://{repo_id}@{unquote(revision)}",
        )
    if revision and (revision == "@" or _BAD_REF.search(revision)):
        raise ConfigError(
            f"bad Hub sink URL {shown!r}: the revision {revision!r} is not a valid branch name",
            hint="git's ref rules apply: no spaces, '..', '~^:?*[\\', '@{', '//', no part starting "
            "with '.' or ending with '.lock', no '.' or '/' at the end",
        )
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
