"""The commit endpoint of the Hub test server: one ndjson commit (`header`, `file`, `lfsFile`, `deletedFile`,
`deletedFolder`) on top of a branch, refused with a 412 when `parentCommit` is not the branch's head.

A mixin of `HubApp`, which supplies the store, the stats and the repo lookup."""

from __future__ import annotations

import base64
import json
from typing import Any

from werkzeug.wrappers import Request, Response

from tests.hubserver.store import Blob, Repo
from tests.hubserver.wire import HubFail, _json


class CommitEndpoints:
    """`h_commit`: what `create_commit` sends."""

    def h_commit(self, request: Request, org: str, name: str, rev: str, **_: Any) -> Response:
        repo, user = self._repo(request, org, name, write=True)
        lines = [json.loads(line) for line in request.get_data().splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise HubFail(400, "the first ndjson line must be the header")
        header = lines[0]["value"]
        with self.store.lock:
            if rev not in repo.branches:
                if repo.resolve(rev) is not None:
                    raise HubFail(400, f"{rev} is not a branch")
                raise HubFail(404, f"Invalid rev id: {rev}", "RevisionNotFound")
            head = repo.commits[repo.branches[rev]]
            parent = header.get("parentCommit")
            if parent is not None and parent != head.oid:
                raise HubFail(412, f"A commit has happened since {parent}. Please refresh and try again.")
            tree = dict(head.tree)
            for line in lines[1:]:
                self._apply(repo, tree, line.get("key"), line.get("value") or {})
            commit = self.store.commit(
                repo, rev, header.get("summary", ""), header.get("description", ""), user, tree
            )
        added = tuple(ln["value"]["path"] for ln in lines[1:] if ln.get("key") in ("file", "lfsFile"))
        with self.stats.lock:
            self.stats.commits[repo.repo_id] += 1
            self.stats.commit_adds.append(added)
        base = request.host_url.rstrip("/")
        return _json(
            {
                "success": True,
                "commitOid": commit.oid,
                "commitUrl": f"{base}/{repo.repo_id}/commit/{commit.oid}",
                "hookOutput": "",
            }
        )

    @staticmethod
    def _apply(repo: Repo, tree: dict[str, Blob], key: str | None, value: dict) -> None:
        path = value.get("path", "")
        if not path or path.startswith("/") or ".." in path.split("/"):
            raise HubFail(400, f"invalid path {path!r}")
        if key == "file":
            if value.get("encoding", "base64") != "base64":
                raise HubFail(400, "only base64 file content is supported")
            tree[path] = Blob.regular(base64.b64decode(value.get("content", "")))
        elif key == "lfsFile":
            # The oid is the file's sha256: an LFS object of the repo, or a Xet file a shard uploaded with
            # one of the repo's CAS tokens registered under that sha256.
            oid = value.get("oid")
            xet_hash, size = repo.xet.get(oid, (None, repo.lfs.get(oid)))
            if size is None:
                raise HubFail(422, f"Your push was rejected: LFS object {oid} for {path} was never uploaded")
            if value.get("size") is not None and value["size"] != size:
                raise HubFail(422, f"LFS object {oid} for {path} has size {size}, not {value['size']}")
            tree[path] = Blob.lfs(oid, size, xet_hash)
        elif key == "deletedFile":
            if tree.pop(path, None) is None:
                raise HubFail(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
        elif key == "deletedFolder":
            for p in [p for p in tree if p.startswith(path.rstrip("/") + "/")]:
                del tree[p]
        else:
            raise HubFail(400, f"unknown commit operation {key!r}")
