"""The export as the Hub sees it, and the pure planning of one commit: what to add, keep and delete."""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from stagerd.contract.export_tree import walk_entries
from stagerd.errors import (
    VerifyError,
)
from stagerd.sinks.hub.url import (
    _FORBIDDEN_DIRS,
    _GIT_OID_MAX,
    _HASH_CHUNK,
    GITATTRIBUTES,
    title_step,
)

log = logging.getLogger("stagerd.sinks.hub")

# Files at a repo's top level that `from_pretrained` would read in place of an export's model: other
# weights, sharded or not (`model.safetensors` is read before `model.safetensors.index.json`), and an
# adapter's (with its `adapter_config.json` the repo loads as an adapter on the base it names). A commit
# deletes each one the export lacks, whoever wrote it. An adapter's export is read by its config, so only
# an adapter's weights stand in its place: a model's weights beside it (its base, say) are not deleted.
_MODEL_WEIGHTS = re.compile(
    r"(?:model|pytorch_model|tf_model|flax_model)(?:-[0-9]{5}-of-[0-9]{5})?"
    r"\.(?:safetensors|bin|h5|msgpack)(?:\.index\.json)?"
)
_ADAPTER_FILES = re.compile(r"adapter_model\.(?:safetensors|bin)|adapter_config\.json")
_ADAPTER_CONFIG = "adapter_config.json"


def _read_instead(path: str, adapter: bool) -> bool:
    return bool(_ADAPTER_FILES.fullmatch(path) or (not adapter and _MODEL_WEIGHTS.fullmatch(path)))


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
    """One file of a remote tree: size, git blob id, the LFS sha256 when the file is in LFS, and the title
    of the last commit that changed it (None where the Hub did not say)."""

    path: str
    size: int
    blob_id: str
    lfs_sha256: str | None
    last_commit_title: str | None = None


def left_beside(remote: RemoteFile, *, adapter: bool = False) -> bool:
    """A file a commit leaves as it is, though the export (`adapter`: a PEFT adapter's) lacks it: one a
    person (or another tool) wrote last, such as a LICENSE, a `.gitignore` or a hand-written model card,
    and not one a loader would read in place of the export's. A file stagerd wrote last (an older step's
    shard or extra) is not: the branch is the export's."""
    if remote.path == GITATTRIBUTES:
        return True
    if remote.last_commit_title is None or title_step(remote.last_commit_title) is not None:
        return False
    return not _read_instead(remote.path, adapter)


def is_adapter(local: Sequence[HubFile]) -> bool:
    """Whether the export is a PEFT adapter's: `from_pretrained` reads it by its `adapter_config.json`."""
    return any(f.path == _ADAPTER_CONFIG for f in local)


@dataclass(frozen=True)
class CommitPlan:
    """What one step's commit does, relative to its parent tree."""

    adds: tuple[str, ...]  # files whose content the parent lacks: the only ones uploaded and committed
    kept: tuple[str, ...]  # files the parent already holds with the same content: left out of the commit
    deletes: tuple[str, ...]  # the parent's files that stagerd wrote and the export lacks, and stale weights
    new_bytes: int  # the size of `adds`
    beside: tuple[str, ...] = ()  # the parent's files that are not the export's, left as they are


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
    from the parent instead of being sent again); of what the parent holds beyond the export, delete what
    stagerd wrote and stale weights, and leave the rest (`left_beside`)."""
    files = [*local, *([card] if card else [])]
    keep = {f.path for f in files}
    extra = sorted(p for p in parent if p not in keep)
    adapter = is_adapter(local)
    beside = tuple(p for p in extra if left_beside(parent[p], adapter=adapter))
    deletes = tuple(p for p in extra if p not in beside)
    changed = [f for f in files if f.path not in parent or not _same(f, parent[f.path])]
    kept = tuple(f.path for f in files if f not in changed)
    return CommitPlan(tuple(f.path for f in changed), kept, deletes, sum(f.size for f in changed), beside)


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
    extra = sorted(set(remote) - expected)
    adapter = is_adapter(local)
    problems += [f"{p}: not in the export" for p in extra if not left_beside(remote[p], adapter=adapter)]
    return problems
