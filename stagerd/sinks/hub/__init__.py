"""`HubSink`: publish an export to a Hugging Face Hub model repo, one atomic commit per step.

URL: `hf://ORG/REPO[@REVISION][?option=value&...]`. Options (keyword arguments win over the query):
`token` (default: `HF_TOKEN` or the huggingface_hub login), `endpoint` (default: `HF_ENDPOINT` or the
public Hub), `private` (default true: a missing repo is created private), `branch_per_step` (default
false: each step is committed to `REVISION`, `main` by default), and the retry knobs `max_attempts`,
`backoff_base`, `backoff_max`, `max_retry_after` (seconds), and the request bounds `timeout` (seconds the
Hub may keep any one request waiting, default 60) and `connect_timeout` (default 10).

One publish is exactly one `HfApi.create_commit` (never `upload_folder`, which may split a folder into
several commits) with the message `stagerd: step N`, then the tag `step-N` on that commit (off main, both
scoped to the revision: see below). The commit
names its `parent_commit`, so a concurrent writer makes it fail (and be re-planned) instead of being
overwritten. Of the files the parent holds and the export lacks, it deletes those stagerd wrote (an earlier
step's shard or extra: the Hub names each file's last commit, `tree.left_beside`) and weights a loader would
read in place of the export's, whoever wrote them; a person's files (a LICENSE, a `.gitignore`, notes)
stay as they are, and so does a `README.md` a person wrote or edited, instead of the generated card.

Only what changed is sent: a file whose sha256 (or git blob id) equals the parent commit's entry is left
out of the commit's operations, which keeps it from the parent. The rest goes through Xet when hf_xet is
installed (the sink runs that upload itself, bounded by its timeouts: `upload.py`, `xet.py`), else
through LFS inside `create_commit`. `bytes_uploaded` is what went over the wire.

A sink's steps are scoped to its revision (`url.py`), so sinks on two branches of one repo never take
each other's step: on `main`, the tag `step-N`, the title `stagerd: step N` and the step branch
`stagerd/step-N`; on any other revision R, the tag `R/step-N`, the title `stagerd: step N on R` and the
step branch `stagerd/R/step-N`.

Idempotence is read from the repo itself: the sink's tag for step N means published only when it marks the
commit titled for step N found on the sink's own branches (its revision, its step branch); a tag that marks
anything else is a `SinkConflictError` naming the tag, never "already published". A commit titled for the
step without the tag (a crash between commit and tag) gets the tag and nothing else. The sink deletes no tag
or branch, and commits onto an existing step branch only while it holds nothing the revision does not (one
it made before a crash): a person's commits there are a `SinkConflictError` naming the branch, also where
the branch appears between the sink's read of the refs and its `create_branch` (the Hub's 409 is checked,
never taken for the sink's own). `REVISION` must be a branch (made from main if missing): a tag of the repo
is a `SinkConflictError`, a commit id or a `refs/...` name a `ConfigError`, before anything is written; so is
(a `SinkConflictError`) a tag that the step's tag cannot sit beside (`step-6/rc1`: refs are paths). Before
returning, the tree at the commit is listed and compared with the export: names, sizes, LFS sha256 or the
git blob id.

A crash between commit and tag leaves the step's commit near the head of its branch (steps are committed in
increasing order), so the history is read newest first, page by page, only until that commit, a stagerd
commit of an earlier step (or of another revision: the history a branch was created from), or `_HISTORY_CAP`
commits, so that walk does not grow with the history (the refs listing still does: it names every tag).
Where the walk ends at the cap without an answer (a long run's old step), the tag's own commit is read, one
request, and counts when it is titled for the step on this revision (`history.py`).

Upgrades: an older stagerd named a step on revision R as on main (`stagerd: step N`, tag `step-N`, branch
`stagerd/step-N`). Such a commit on R's own branch is R's step N when it is newer than where R's history
meets main's, and meets every other branch a person made (not `stagerd/...`): a branch made from main holds
main's `stagerd: step N` commits too, and those stay main's. The histories are read newest first, in step,
until they meet or the cap (`history.py`). The sink then tags such a commit `R/step-N` with no new commit,
counts it published when the old tag `step-N` marks it, and commits later steps in order after it;
`restore @R --step N` reads it there. Where a meeting point is not seen within the cap (main's history
squashed, or far ahead), or another branch holds the commit too, it is not R's, and a warning names the
commit and the tag to set by hand. That stagerd's step branch for an older step of R was `stagerd/step-N`,
main's name: its commit is R's when the branch was made from one of R's own commits (`own_old_branch`),
and main's only when made from main's history (`made_from`). Not told apart: on main, a tag beyond the cap
is judged by its commit's title alone, so where main's walk ends at the cap, an older stagerd's repo-wide
tag `step-N` on another revision's commit reads as main's step N.

Every request is bounded: huggingface_hub 2.4 shares one HTTP client per process with no timeout and offers
no per-`HfApi` client, so the sink installs (once, through `set_client_factory`) a request hook that bounds
each request to a registered endpoint by that endpoint's timeouts, and requests elsewhere (LFS upload URLs)
by the most generous registered bound. A request the Hub leaves unanswered ends in a retryable "the Hub
did not answer within N s".

Errors: 401/403 (or a repo the token cannot see) raise `SinkAuthError` at once; 429 waits for
`Retry-After`; 5xx, 408, 409/412 (a moved branch), timeouts and dropped connections are retried with
bounded exponential backoff; other failures raise `SinkError`. Each failed request is one of the sink's
attempts: huggingface_hub does not retry the sink's requests itself (`one_policy.py`). The token never
appears in messages or logs.
"""

from __future__ import annotations

from stagerd.sinks.hub.history import Scan, above_fork, scan_history
from stagerd.sinks.hub.sink import HubSink
from stagerd.sinks.hub.timeouts import HubTimeouts
from stagerd.sinks.hub.tree import HubFile, RemoteFile, compare_tree, plan_commit, scan_export
from stagerd.sinks.hub.url import (
    _HISTORY_CAP,
    _HISTORY_PAGE,
    commit_message,
    parse_hub_url,
    step_branch,
    step_tag,
)

__all__ = [
    "_HISTORY_CAP",
    "_HISTORY_PAGE",
    "HubFile",
    "HubSink",
    "HubTimeouts",
    "RemoteFile",
    "Scan",
    "above_fork",
    "commit_message",
    "compare_tree",
    "parse_hub_url",
    "plan_commit",
    "scan_export",
    "scan_history",
    "step_branch",
    "step_tag",
]
