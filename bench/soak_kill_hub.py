"""The crash soak's Hub sink (`bench/soak_kill.py --hub xet|lfs`): the repo's Hub test server
(tests/hubserver) in the soak's process, the sentinels on the repo that nothing may touch, and the checks of
the repo once a clean daemon settled the run.

The repo `soak/run1` gets, before the first step, a person's branch `notes` (one commit of their own) and
their tag `v0` on it. Xet or LFS is huggingface_hub's choice, set for the daemon by `HF_HUB_DISABLE_XET`.
A kill inside an upload body (an LFS PUT or part, a Xet xorb) comes from the server: `arm_body_kill`.

Checks (`check_hub`):
- the tags are exactly `step-1`..`step-N` and `v0`; each `step-s` marks a commit titled `stagerd: step s`;
- exactly one `stagerd: step s` commit per step over every branch (a killed run's commit is tagged by the
  restart, never made twice); `main`'s head is the newest step's commit;
- the branches are `main`, `notes` (still at the person's commit) and only step branches `stagerd/step-s`
  whose head is step s's tagged commit (a step committed after a newer one: what a retry legitimately
  makes, nothing a killed run left);
- each step's tree at its tag is exactly its reference export (names, sizes, LFS sha256 or git blob id),
  plus `.gitattributes` and the generated `README.md`: the newest steps and a sample of older ones (each
  needs a clean consolidate); the newest steps' bytes are checked whole by the restore phase
  (`soak_kill_restore.py`).
"""

from __future__ import annotations

import hashlib
import os
import signal
from pathlib import Path
from typing import Any

REPO_ID = "soak/run1"
TITLE = "stagerd: step "


class HubSide:
    """The Hub test server and its repo for one soak."""

    def __init__(self, work: Path, mode: str) -> None:
        from tests.hubserver import HubConfig, HubServer

        self.mode = mode
        # multipart from 8 MiB: the big model's 34 MB file goes in parts on LFS
        config = HubConfig(multipart_threshold=8 << 20, multipart_chunk_size=8 << 20)
        self.server = HubServer(work / "hub", config=config).start()
        self.url = f"hf://{REPO_ID}"
        self.env = dict(
            HF_ENDPOINT=self.server.endpoint,
            HF_TOKEN=self.server.token,
            HF_HUB_DISABLE_PROGRESS_BARS="1",
            HF_HOME=str(work / "hf-home"),
            HF_XET_CACHE=str(work / "hf-xet-cache"),
        )
        if mode == "lfs":
            self.env["HF_HUB_DISABLE_XET"] = "1"
        self.body_kills = 0
        self._place_sentinels()

    def api(self) -> Any:
        from huggingface_hub import HfApi

        return HfApi(endpoint=self.server.endpoint, token=self.server.token)

    def _place_sentinels(self) -> None:
        from huggingface_hub import CommitOperationAdd

        api = self.api()
        api.create_repo(REPO_ID, exist_ok=True)
        api.create_branch(REPO_ID, branch="notes")
        info = api.create_commit(
            REPO_ID,
            [CommitOperationAdd("notes.txt", b"a person's notes")],
            commit_message="a person's notes",
            revision="notes",
        )
        api.create_tag(REPO_ID, tag="v0", revision=info.oid)
        self.sentinel_commit = info.oid

    def arm_body_kill(self, pid: int, after: int) -> None:
        """SIGKILL `pid` once an upload body (LFS PUT or part, Xet xorb) has `after` bytes in."""

        def kill() -> None:
            try:
                os.kill(pid, signal.SIGKILL)
                self.body_kills += 1
            except ProcessLookupError:
                pass

        self.server.on_lfs_body(after, kill)

    def disarm(self) -> None:
        self.server.app.lfs_hook = None

    def stop(self) -> None:
        self.server.stop()


def _want_tree(ref: Path) -> dict[str, tuple[int, str]]:
    """An export's files as the Hub's tree lists them: (size, sha256) for LFS files, (size, git blob id)
    for small ones kept in git (the sink's rule: weights and binaries are LFS; the tree says which)."""
    out = {}
    for p in ref.rglob("*"):
        if p.is_file():
            data = p.read_bytes()
            out[p.relative_to(ref).as_posix()] = (
                len(data),
                hashlib.sha256(data).hexdigest(),
                hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest(),
            )
    return out


def check_hub(hub: HubSide, last_step: int, refs: dict[int, Path]) -> list[str]:
    api = hub.api()
    fails: list[str] = []
    refs_now = api.list_repo_refs(REPO_ID)
    tags = {t.name: t.target_commit for t in refs_now.tags}
    branches = {b.name: b.target_commit for b in refs_now.branches}
    want_tags = {f"step-{s}" for s in range(1, last_step + 1)} | {"v0"}
    if set(tags) != want_tags:
        fails.append(
            f"Hub tags: extra {sorted(set(tags) - want_tags)}, missing {sorted(want_tags - set(tags))}"
        )
    if tags.get("v0") != hub.sentinel_commit or branches.get("notes") != hub.sentinel_commit:
        fails.append("Hub sentinel branch `notes` or tag `v0` moved or deleted")
    commits: dict[str, str] = {}  # commit id -> title, over every branch
    for b in branches:
        for c in api.list_repo_commits(REPO_ID, revision=b):
            commits[c.commit_id] = c.title
    per_step: dict[int, list[str]] = {}
    for cid, title in commits.items():
        if title.startswith(TITLE) and title[len(TITLE) :].isdigit():
            per_step.setdefault(int(title[len(TITLE) :]), []).append(cid)
    twice = {s: len(c) for s, c in per_step.items() if len(c) != 1}
    missing = sorted(set(range(1, last_step + 1)) - set(per_step))
    if twice or missing or set(per_step) - set(range(1, last_step + 1)):
        fails.append(
            f"Hub: not one `stagerd: step N` commit per step: counts {twice}, missing {missing[:10]}"
        )
    for s in range(1, last_step + 1):
        if f"step-{s}" in tags and [tags[f"step-{s}"]] != per_step.get(s):
            fails.append(f"Hub tag step-{s} marks {tags[f'step-{s}'][:8]}, not the step's commit")
    if branches.get("main") != tags.get(f"step-{last_step}"):
        fails.append(f"Hub main's head is not step {last_step}'s commit")
    for b, head in branches.items():
        if b in ("main", "notes"):
            continue
        s = b.removeprefix("stagerd/step-")
        if not (b.startswith("stagerd/step-") and s.isdigit() and tags.get(f"step-{s}") == head):
            fails.append(f"Hub: branch {b} left (head {head[:8]}), not a step branch holding its tagged step")
    for s, ref in sorted(refs.items()):
        want = _want_tree(ref)
        got = {}
        for e in api.list_repo_tree(REPO_ID, revision=f"step-{s}", recursive=True):
            if hasattr(e, "size"):
                lfs = getattr(e, "lfs", None)
                got[e.path] = (e.size, lfs.sha256 if lfs is not None else e.blob_id)
        extra = sorted(set(got) - set(want) - {"README.md", ".gitattributes"})
        bad = sorted(
            k for k, (size, sha, blob) in want.items() if got.get(k) not in ((size, sha), (size, blob))
        )
        if extra or bad:
            fails.append(f"Hub step {s} at its tag: extra files {extra[:5]}, missing or different {bad[:5]}")
    return fails
