"""The export as the Hub sees it, and the pure planning of one commit: what to add, keep and delete."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from stagerd.contract.export_tree import walk_entries
from stagerd.errors import (
    VerifyError,
)
from stagerd.sinks.hub.url import (
    _FORBIDDEN_DIRS,
    _GIT_OID_MAX,
    _HASH_CHUNK,
    GITATTRIBUTES,
)

if TYPE_CHECKING:
    pass


log = logging.getLogger("stagerd.sinks.hub")

# --- the export ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HubFile:
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


def scan_export(export_dir: Path, *, threads: int = 2) -> list[HubFile]:
    """Every regular file under `export_dir`, hashed once. Bad input is a VerifyError naming the file."""
    if not export_dir.is_dir():
        raise VerifyError("export directory does not exist", path=export_dir)
    root = export_dir.resolve()
    found: list[tuple[str, Path, int]] = []
    for rel, p in walk_entries(export_dir):
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
    return [HubFile(rel, size, sha, git) for (rel, _, size), (sha, git) in zip(found, hashes, strict=True)]


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

    adds: tuple[str, ...]  # files whose content the parent lacks: the only ones uploaded and committed
    kept: tuple[str, ...]  # files the parent already holds with the same content: left out of the commit
    deletes: tuple[str, ...]
    new_bytes: int  # the size of `adds`


def _same(local: HubFile, remote: RemoteFile) -> bool:
    if remote.size != local.size:
        return False
    if remote.lfs_sha256 is not None:
        return remote.lfs_sha256 == local.sha256
    return local.git_oid is not None and remote.blob_id == local.git_oid


def plan_commit(
    local: Sequence[HubFile], card: HubFile | None, parent: Mapping[str, RemoteFile]
) -> CommitPlan:
    """Add what the parent lacks (a file whose sha256, or git blob id, equals the parent's entry is kept
    from the parent instead of being sent again), delete what the parent holds beyond the export."""
    files = [*local, *([card] if card else [])]
    keep = {f.path for f in files} | {GITATTRIBUTES}
    deletes = tuple(sorted(p for p in parent if p not in keep))
    changed = [f for f in files if f.path not in parent or not _same(f, parent[f.path])]
    kept = tuple(f.path for f in files if f not in changed)
    return CommitPlan(tuple(f.path for f in changed), kept, deletes, sum(f.size for f in changed))


def compare_tree(
    local: Sequence[HubFile], card: HubFile | None, remote: Mapping[str, RemoteFile], *, card_exact: bool
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
