"""The `file://` backend: fsync'd writes renamed into place, the manifest created by `link()`."""

from __future__ import annotations

import builtins
import contextlib
import fcntl
import hashlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from stagerd.contract import layout
from stagerd.contract.regular_file import read_regular
from stagerd.ops.crashpoints import crash_point
from stagerd.sinks.claims import claim_key
from stagerd.sinks.fetch import LATEST_NAME
from stagerd.sinks.hashing import hash_file, iter_file
from stagerd.sinks.objects import (
    MAX_LATEST_BYTES,
    ByteProgress,
    LocalFile,
    RemoteObject,
    Uploaded,
    changed_error,
    foreign_latest,
    newer_latest,
    probe_clock,
    refuse_links,
)
from stagerd.sinks.temp_names import HOST, TEMP_NAME, pid_alive, temp_name

log = logging.getLogger("stagerd.sinks.fsspec")

# A temp file not ours (another host's, or one naming no host) whose writer stopped writing it this long
# ago by the store's clock: a live writer renames `latest`'s within milliseconds and writes an upload's
# without pause, so it is a killed one's (or a lost host's), left for good otherwise.
TEMP_STALE_S = 3600.0


class LocalBackend:
    """`file:///PATH`: fsync'd writes, each file renamed into place, the manifest created by `link`."""

    has_checksums = False

    def __init__(self, root: Path) -> None:
        self.root = root

    def list(self, prefix: str) -> dict[str, RemoteObject]:
        self.refuse_links(f"{prefix}/-")  # the prefix's own directories too
        base = self.root / prefix
        out = {}
        for dirpath, _dirs, names in os.walk(base):
            for name in names:
                if TEMP_NAME.fullmatch(name):
                    continue  # our own temp files
                p = Path(dirpath) / name
                out[p.relative_to(base).as_posix()] = RemoteObject(p.stat().st_size)
        return out

    def checksums(self, prefix: str, rels: builtins.list[str]) -> dict[str, str | None]:
        return dict.fromkeys(rels)

    def sweep(self, prefix: str, *, settled: bool = False) -> None:
        """Unlink temp files whose writer is dead: under `prefix/`, and those of `latest` next to it (only
        those: the sink's directory may hold other tools' files, and temp names like ours). `settled`:
        under `prefix/`, every other host's too (see `Backend.sweep`)."""
        self.refuse_links(f"{prefix}/-")  # the prefix's own directories too
        base = self.root / prefix
        inside = [Path(d) / n for d, _, names in os.walk(base) for n in names]
        beside = []
        for top in {self.root, base.parent}:
            names = os.listdir(top) if top.is_dir() else []
            beside += [top / n for n in names if n.startswith(f".{LATEST_NAME}.tmp-")]
        # A claim, or a prune's, is written to a temp name in `claims/` too: a killed writer's stays there
        # after its step is published again or pruned, one more file every kill, unless swept here.
        if any(layout.parse_step_dir(part) is not None for part in prefix.split("/")):
            claims_dir = (self.root / claim_key(prefix)).parent
            names = os.listdir(claims_dir) if claims_dir.is_dir() else []
            beside += [claims_dir / n for n in names if n.startswith(".step-")]
        now: float | None = None
        for p, under in [(p, True) for p in inside] + [(p, False) for p in beside]:
            m = TEMP_NAME.fullmatch(p.name)
            if m is None:
                continue
            if m["host"] == HOST:
                if not pid_alive(int(m["pid"])):
                    p.unlink(missing_ok=True)
                continue
            if settled and under:
                p.unlink(missing_ok=True)
                continue
            # Another host's pid says nothing here, and an older stagerd's name says no host: either may
            # be a live writer on another host, so only what nobody has written for long goes.
            if m["old"] is not None and pid_alive(int(m["old"])):
                continue
            try:
                mtime = p.stat().st_mtime
            except FileNotFoundError:
                continue
            now = _store_now(self.root) if now is None else now
            if now - mtime > TEMP_STALE_S:
                p.unlink(missing_ok=True)

    def refuse_links(self, key: str) -> Path:
        """`root/key`, never through a link below the sink's root (`objects.refuse_links`)."""
        return refuse_links(self.root, key)

    def read(self, key: str, limit: int | None = None) -> bytes | None:
        try:  # a FIFO at a claim's or a manifest's key held the publish for good
            return read_regular(self.refuse_links(key), limit)
        except FileNotFoundError:
            return None

    def write(self, key: str, data: bytes) -> None:
        path = self.refuse_links(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        layout.write_bytes_atomic(path, data, tmp=_temp_name(path))  # the host in the name: see sweep

    def create(self, key: str, data: bytes) -> bool:
        path = self.refuse_links(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = _temp_name(path)
        self._write_fsync(tmp, [memoryview(data)])
        crash_point("file.create")
        try:
            os.link(tmp, path)
            layout.fsync_dir(path.parent)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def move_latest(self, key: str, name: bytes, step: int) -> None:
        """Read-judge-write `latest` under a lock on its directory: two publishes of this sink at once
        (`publish_workers`, two daemons) could otherwise read the same old value and write in the wrong
        order, leaving `latest` behind a published step."""
        path = self.refuse_links(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(path.parent):
            # another tool's `latest/`, a link to its newest checkpoint, or a FIFO: names no step
            if path.exists() and not path.is_file():
                log.warning(
                    "%s is not a file: another tool's, left as it is; latest is not moved",
                    path,
                    extra={"sink": str(path)},
                )
                return
            current = self.read(key, MAX_LATEST_BYTES + 1)
            foreign_latest(current, str(path))
            if newer_latest(current, step) and current != name:
                self.write(key, name)

    def digest(self, f: LocalFile) -> Uploaded:
        d = hash_file(f.path)
        return Uploaded(f.rel, d.size, d.sha256, None)

    def upload(
        self, prefix: str, files: builtins.list[LocalFile], progress: ByteProgress
    ) -> builtins.list[Uploaded]:
        out = []
        dirs = set()
        for f in files:
            dst = self.refuse_links(f"{prefix}/{f.rel}")
            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp = _temp_name(dst)
            h = hashlib.sha256()

            def chunks(f: LocalFile = f, h: Any = h) -> Any:
                for view in iter_file(f.path):
                    h.update(view)
                    progress(len(view))
                    yield view

            size = self._write_fsync(tmp, chunks())
            if size != f.size:
                tmp.unlink(missing_ok=True)
                raise changed_error(f, size)
            crash_point("file.upload")
            os.replace(tmp, dst)
            dirs.add(dst.parent)
            out.append(Uploaded(f.rel, size, h.hexdigest(), None))
        for d in sorted(dirs):
            layout.fsync_dir(d)
        return out

    @staticmethod
    def _write_fsync(path: Path, chunks: Any) -> int:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        size = 0
        try:
            for view in chunks:
                while view:
                    n = os.write(fd, view)
                    size += n
                    view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        return size

    def close(self) -> None:
        pass


def _temp_name(path: Path) -> Path:
    return temp_name(path, HOST)  # this module's HOST, read at each call


def _store_now(root: Path) -> float:
    """The store's time now (`probe_clock`), or this host's where nothing can be written."""
    try:
        return probe_clock(root)
    except OSError:
        return time.time()  # a read-only sink: nothing of ours to sweep there anyway


_THREAD_LOCKS: dict[str, threading.Lock] = {}
_THREAD_LOCKS_GUARD = threading.Lock()


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """An exclusive lock on `directory`: a thread lock within this process, and `flock` on the directory
    against other processes. A filesystem without `flock` on directories (some NFS mounts) keeps only the
    thread lock, the read-then-write other fsspec stores have."""
    name = os.path.realpath(directory)
    with _THREAD_LOCKS_GUARD:
        lock = _THREAD_LOCKS.setdefault(name, threading.Lock())
    with lock:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY)
        try:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the flock
