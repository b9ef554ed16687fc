"""The `file://` backend: fsync'd writes renamed into place, the manifest created by `link()`, each made
through the sink's directories held open from its root (`local_dirs.py`), never through a link."""

from __future__ import annotations

import builtins
import contextlib
import fcntl
import hashlib
import itertools
import logging
import os
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from stagerd.contract import layout
from stagerd.ops.crashpoints import crash_point
from stagerd.ops.processes import pid_alive
from stagerd.sinks.claims import claim_key
from stagerd.sinks.fetch import LATEST_NAME
from stagerd.sinks.hashing import hash_file, iter_file
from stagerd.sinks.local_dirs import Held, LocalTree
from stagerd.sinks.objects import (
    MAX_LATEST_BYTES,
    ByteProgress,
    LocalFile,
    RemoteObject,
    Uploaded,
    changed_error,
    foreign_latest,
    newer_latest,
)
from stagerd.sinks.temp_names import HOST, TEMP_NAME, temp_name

log = logging.getLogger("stagerd.sinks.fsspec")

# A temp file not ours (another host's, or one naming no host) whose writer stopped writing it this long
# ago by the store's clock: a live writer renames `latest`'s within milliseconds and writes an upload's
# without pause, so it is a killed one's (or a lost host's), left for good otherwise.
TEMP_STALE_S = 3600.0


class LocalBackend:
    """`file:///PATH`: fsync'd writes, each file renamed into place, the manifest created by `link`; every
    one made through the sink's directories held from its root, never through a link (`local_dirs.py`)."""

    has_checksums = False

    def __init__(self, root: Path) -> None:
        self.root = root
        self.tree = LocalTree(root)

    def list(self, prefix: str) -> dict[str, RemoteObject]:
        return {
            rel: RemoteObject(st.st_size)
            for _fd, rel, name, st in self.tree.files(prefix)
            if not TEMP_NAME.fullmatch(name)  # our own temp files
        }

    def checksums(self, prefix: str, rels: builtins.list[str]) -> dict[str, str | None]:
        return dict.fromkeys(rels)

    def sweep(self, prefix: str, *, settled: bool = False) -> None:
        """Unlink temp files whose writer is dead: under `prefix/`, and those of `latest` next to it (only
        those: the sink's directory may hold other tools' files, and temp names like ours). `settled`:
        under `prefix/`, every other host's too (see `Backend.sweep`)."""
        clock = _Clock(self.tree)
        for fd, _rel, name, st in self.tree.files(prefix):
            if _stale(name, st, settled=settled, clock=clock):
                _unlink_at(fd, name)
        parent = prefix.rpartition("/")[0]
        beside = [("", f".{LATEST_NAME}.tmp-")] + ([(parent, f".{LATEST_NAME}.tmp-")] if parent else [])
        # A claim, or a prune's, is written to a temp name in `claims/` too: a killed writer's stays there
        # after its step is published again or pruned, one more file every kill, unless swept here.
        if any(layout.parse_step_dir(part) is not None for part in prefix.split("/")):
            beside.append((claim_key(prefix).rpartition("/")[0], ".step-"))
        for rel, start in beside:
            for fd, found, name, st in self.tree.files(rel, start):
                if "/" not in found and _stale(name, st, settled=False, clock=clock):
                    _unlink_at(fd, name)

    def refuse_links(self, key: str) -> Path:
        """`root/key`; a SymlinkError where a directory on the way to it below the sink's root is a link."""
        with contextlib.suppress(FileNotFoundError, NotADirectoryError), self.tree.parent(key)[0]:
            pass
        return self.root / key

    def read(self, key: str, limit: int | None = None) -> bytes | None:
        return self.tree.read(key, limit)  # never a FIFO's wait (a claim's or a manifest's key)

    def write(self, key: str, data: bytes) -> None:
        name = key.rpartition("/")[2]
        self.tree.write(key, data, _temp_name(Path(name)).name)  # the host in the name: see sweep

    def create(self, key: str, data: bytes) -> bool:
        h, name = self.tree.parent(key, create=True)
        with h:
            tmp = _temp_name(Path(name)).name
            h.new_file(tmp, [memoryview(data)])
            crash_point("file.create")
            try:
                h.link(tmp, name)
            except FileExistsError:
                return False
            finally:
                h.unlink(tmp)
            h.fsync()
            h.check()
            return True

    def move_latest(self, key: str, name: bytes, step: int) -> None:
        """Read-judge-write `latest` under a lock on its directory: two publishes of this sink at once
        (`publish_workers`, two daemons) could otherwise read the same old value and write in the wrong
        order, leaving `latest` behind a published step."""
        h, base = self.tree.parent(key, create=True)
        with h, _locked(h):
            # another tool's `latest/`, a link to its newest checkpoint, or a FIFO: names no step
            st = h.lstat(base)
            if st is not None and not stat.S_ISREG(st.st_mode):
                log.warning(
                    "%s is not a file: another tool's, left as it is; latest is not moved",
                    h.path / base,
                    extra={"sink": str(h.path / base)},
                )
                return
            current = None if st is None else self.read(key, MAX_LATEST_BYTES + 1)
            foreign_latest(current, str(h.path / base))
            if newer_latest(current, step) and current != name:
                self.write(key, name)
            h.check()

    def digest(self, f: LocalFile) -> Uploaded:
        d = hash_file(f.path)
        return Uploaded(f.rel, d.size, d.sha256, None)

    def upload(
        self, prefix: str, files: builtins.list[LocalFile], progress: ByteProgress
    ) -> builtins.list[Uploaded]:
        out = []
        # consecutive files of one directory share its descriptors and its fsync
        for rel, group in itertools.groupby(files, key=lambda f: f"{prefix}/{f.rel}".rpartition("/")[0]):
            with self.tree.held(rel, create=True) as h:
                out += [_upload_one(h, f, progress) for f in group]
                h.fsync()
        return out

    def close(self) -> None:
        pass


def _upload_one(h: Held, f: LocalFile, progress: ByteProgress) -> Uploaded:
    name = f.rel.rpartition("/")[2]
    tmp = _temp_name(Path(name)).name
    sha = hashlib.sha256()

    def chunks() -> Any:
        for view in iter_file(f.path):
            sha.update(view)
            progress(len(view))
            yield view

    size = h.new_file(tmp, chunks())
    if size != f.size:
        h.unlink(tmp)
        raise changed_error(f, size)
    crash_point("file.upload")
    h.rename(tmp, name)
    h.check()
    return Uploaded(f.rel, size, sha.hexdigest(), None)


def _temp_name(path: Path) -> Path:
    return temp_name(path, HOST)  # this module's HOST, read at each call


def _unlink_at(fd: int, name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=fd)


class _Clock:
    """The store's time (`Held.clock` at the root), read once and only when first asked for; this host's
    where nothing can be written (a read-only sink: nothing of ours to sweep there anyway)."""

    def __init__(self, tree: LocalTree) -> None:
        self.tree = tree
        self.now: float | None = None

    def __call__(self) -> float:
        if self.now is None:
            try:
                with self.tree.held("") as h:
                    self.now = h.clock()
            except OSError:
                self.now = time.time()
        return self.now


def _stale(name: str, st: os.stat_result, *, settled: bool, clock: _Clock) -> bool:
    """Whether the file `name` is a temp file whose writer is gone (see `LocalBackend.sweep`)."""
    m = TEMP_NAME.fullmatch(name)
    if m is None or not stat.S_ISREG(st.st_mode):
        return False
    if m["host"] == HOST:
        return not pid_alive(int(m["pid"]))
    if settled:
        return True
    # Another host's pid says nothing here, and an older stagerd's name says no host: either may be a
    # live writer on another host, so only what nobody has written for long goes.
    if m["old"] is not None and pid_alive(int(m["old"])):
        return False
    return clock() - st.st_mtime > TEMP_STALE_S


_THREAD_LOCKS: dict[tuple[int, int], threading.Lock] = {}
_THREAD_LOCKS_GUARD = threading.Lock()


@contextlib.contextmanager
def _locked(held: Held) -> Iterator[None]:
    """An exclusive lock on the held directory: a thread lock within this process, and `flock` on it
    against other processes. A filesystem without `flock` on directories (some NFS mounts) keeps only the
    thread lock, the read-then-write other fsspec stores have."""
    st = os.fstat(held.fd)
    with _THREAD_LOCKS_GUARD:
        lock = _THREAD_LOCKS.setdefault((st.st_dev, st.st_ino), threading.Lock())
    with lock:
        with contextlib.suppress(OSError):
            fcntl.flock(held.fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                fcntl.flock(held.fd, fcntl.LOCK_UN)
