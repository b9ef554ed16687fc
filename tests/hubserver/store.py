"""In-memory git-like model of Hub repositories, with LFS objects kept in a directory.

Test infrastructure only. A repo is a set of commits (each with its full flat tree), branches and tags,
like git but without packing. Regular files live in memory; LFS objects live on disk under `lfs_dir`,
named by sha256, so a multi-GB benchmark upload does not sit in RAM. Files uploaded through Xet are LFS
files whose bytes are in the CAS (`xet_store`), registered to a repo by sha256 when their shard arrives.
"""

from __future__ import annotations

import hashlib
import itertools
import re
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

_BAD_REF = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]|\.\.|@\{|//|^/|/$|\.$|(^|/)\.|\.lock(/|$)")


def valid_ref_name(name: str) -> bool:
    """git's `check-ref-format` rules, which the Hub's git refs follow: `/` separates folders of refs."""
    return name != "@" and _BAD_REF.search(name) is None


LFS_POINTER = "version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n"


def git_blob_oid(data: bytes) -> str:
    """The git object id of a blob: sha1 over `blob <len>\\0<data>`."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def hub_date(ts: datetime) -> str:
    """The Hub's date format: `2024-01-02T03:04:05.678Z`."""
    return ts.strftime("%Y-%m-%dT%H:%M:%S.") + f"{ts.microsecond // 1000:03d}Z"


@dataclass(frozen=True)
class Blob:
    """One file in a tree. LFS files carry `sha256` and no content (and `xet_hash` when stored in Xet);
    regular files carry `content`."""

    size: int
    git_oid: str
    sha256: str | None = None
    content: bytes | None = None
    xet_hash: str | None = None

    @property
    def is_lfs(self) -> bool:
        return self.sha256 is not None

    @property
    def pointer_size(self) -> int:
        return len(LFS_POINTER.format(oid=self.sha256, size=self.size))

    @classmethod
    def regular(cls, data: bytes) -> Blob:
        return cls(size=len(data), git_oid=git_blob_oid(data), content=data)

    @classmethod
    def lfs(cls, sha256: str, size: int, xet_hash: str | None = None) -> Blob:
        pointer = LFS_POINTER.format(oid=sha256, size=size).encode()
        return cls(size=size, git_oid=git_blob_oid(pointer), sha256=sha256, xet_hash=xet_hash)


@dataclass(frozen=True)
class Commit:
    oid: str
    parent: str | None
    title: str
    message: str
    date: datetime
    author: str
    tree: dict[str, Blob]


@dataclass
class Repo:
    repo_id: str
    private: bool
    branches: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    commits: dict[str, Commit] = field(default_factory=dict)
    lfs: dict[str, int] = field(default_factory=dict)  # sha256 -> size, objects uploaded to this repo
    xet: dict[str, tuple[str, int]] = field(default_factory=dict)  # sha256 -> (Xet file hash, size)
    created: datetime = field(default_factory=lambda: datetime.now(UTC))

    def resolve(self, rev: str) -> Commit | None:
        """A branch, a tag or a full commit id -> the commit, or None."""
        oid = self.branches.get(rev) or self.tags.get(rev) or (rev if rev in self.commits else None)
        return self.commits.get(oid) if oid else None

    def last_commit(self, head: Commit, path: str) -> Commit:
        """The newest commit from `head` back that changed `path` (added it, or changed its blob)."""
        cur = head
        while cur.parent is not None:
            before = self.commits[cur.parent].tree.get(path)
            if before is None or before.git_oid != cur.tree[path].git_oid:
                return cur
            cur = self.commits[cur.parent]
        return cur

    def history(self, head: Commit) -> list[Commit]:
        """Commits from `head` back to the root, newest first."""
        out, cur = [], head
        while cur is not None:
            out.append(cur)
            cur = self.commits.get(cur.parent) if cur.parent else None
        return out


GITATTRIBUTES = (
    b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
    b"*.bin filter=lfs diff=lfs merge=lfs -text\n"
    b"*.pt filter=lfs diff=lfs merge=lfs -text\n"
)


class HubStore:
    """All repos of one server. Every public method holds the lock: the HTTP server is threaded."""

    def __init__(self, lfs_dir: Path) -> None:
        self.lfs_dir = lfs_dir
        self.lfs_dir.mkdir(parents=True, exist_ok=True)
        self.repos: dict[str, Repo] = {}
        self.lock = threading.RLock()
        self._seq = itertools.count(1)

    def lfs_path(self, sha256: str) -> Path:
        return self.lfs_dir / sha256

    def create_repo(self, repo_id: str, *, private: bool, author: str) -> Repo | None:
        """Create a repo with the Hub's initial commit (`.gitattributes`); None if it exists."""
        with self.lock:
            if repo_id in self.repos:
                return None
            repo = Repo(repo_id=repo_id, private=private)
            self.repos[repo_id] = repo
            self._commit(
                repo, None, "initial commit", "", author, {".gitattributes": Blob.regular(GITATTRIBUTES)}
            )
            repo.branches["main"] = next(iter(repo.commits))
            return repo

    def commit(
        self, repo: Repo, branch: str, title: str, message: str, author: str, tree: dict[str, Blob]
    ) -> Commit:
        """Append a commit with `tree` on top of `branch` and move the branch."""
        with self.lock:
            c = self._commit(repo, repo.branches[branch], title, message, author, tree)
            repo.branches[branch] = c.oid
            return c

    def _commit(
        self, repo: Repo, parent: str | None, title: str, message: str, author: str, tree: dict[str, Blob]
    ) -> Commit:
        h = hashlib.sha1(f"{repo.repo_id}\n{parent}\n{title}\n{next(self._seq)}\n".encode())
        for path in sorted(tree):
            h.update(f"{path}\0{tree[path].git_oid}\n".encode())
        c = Commit(h.hexdigest(), parent, title, message, datetime.now(UTC), author, dict(tree))
        repo.commits[c.oid] = c
        return c


def list_tree(tree: dict[str, Blob], prefix: str, recursive: bool) -> list[tuple[str, str, Blob | None]]:
    """Entries under `prefix` as (type, path, blob): `file` with its blob, `directory` with None.

    Directories are listed before files at each level, like the Hub; the order is otherwise by path.
    """
    base = prefix.strip("/")
    start = f"{base}/" if base else ""
    files = {p: b for p, b in tree.items() if p.startswith(start)}
    dirs: set[str] = set()
    out_files = []
    for path, blob in files.items():
        rest = path[len(start) :].split("/")
        for i in range(1, len(rest)):
            d = start + "/".join(rest[:i])
            if recursive or i == 1:
                dirs.add(d)
        if recursive or len(rest) == 1:
            out_files.append(("file", path, blob))
    entries = [("directory", d, None) for d in sorted(dirs)] + sorted(out_files, key=lambda e: e[1])
    return entries


def folder_oid(tree: dict[str, Blob], path: str) -> str:
    """A stable id for a folder: sha1 over its files' paths and oids."""
    h = hashlib.sha1()
    for p in sorted(tree):
        if p.startswith(path + "/"):
            h.update(f"{p}\0{tree[p].git_oid}\n".encode())
    return h.hexdigest()
