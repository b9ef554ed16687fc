"""A file:// sink's directories held open from its root, one name at a time, never through a link.

Checking that no directory on the way to a key is a link and then writing by path lets a link put there
in between lead the write, rename or delete out of the sink. Here each directory below the sink's root is
opened from its parent's descriptor with O_NOFOLLOW (a link is a SymlinkError naming it), and every
create, write, rename, delete, listing and read is made relative to the descriptor held: it lands in that
very directory whatever is put at its path meanwhile, never outside. `Held.check`, after each change,
says when the path no longer names what was held (a link put there: SymlinkError), so a caller never
reports as done what a reader of the path will not find. The root itself may be a link: the operator
named it. A walk holds one descriptor per level of the key, closed when its operation ends: a step's
file count never adds descriptors.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from stagerd.contract.regular_file import is_link_at, linked, open_regular_at, read_bounded
from stagerd.errors import SinkError
from stagerd.ops.crashpoints import crash_point
from stagerd.ops.processes import pid_alive
from stagerd.sinks.objects import CLOCK_NAME
from stagerd.sinks.temp_names import HOST, TEMP_NAME, temp_name

WHY = "stagerd writes and deletes only inside the sink"
HINT = "replace the link by the real directory it stands for (its target was left as it is), then retry"
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# A temp name is predictable: one there already (a dead writer's, or a link or hard link put there) is
# removed first, never written through; O_EXCL then makes the file ours.
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_dir(parent: int, name: str, path: Path) -> int:
    try:
        return os.open(name, _DIR, dir_fd=parent)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR) and is_link_at(name, parent):
            raise linked(path, WHY, HINT) from None
        e.filename = str(path)
        raise


class Held:
    """The directories from the sink's root down to `path`, each held open; `fd` is the last one's."""

    def __init__(self, root: Path, names: list[str], fds: list[int]) -> None:
        self.root, self.names, self.fds = root, names, fds
        self.path = root.joinpath(*names)
        self._ids = [_ident(os.fstat(fd)) for fd in fds]

    @property
    def fd(self) -> int:
        return self.fds[-1]

    def close(self) -> None:
        for fd in reversed(self.fds):
            os.close(fd)
        self.fds = []

    def __enter__(self) -> Held:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check(self) -> None:
        """A SymlinkError if a name on the way is a link now, a SinkError if it names another directory or
        none: what was done went into the directories held, which a reader of the path no longer finds."""
        for i, name in enumerate(self.names):
            at = self.root.joinpath(*self.names[: i + 1])
            try:
                st = os.stat(name, dir_fd=self.fds[i], follow_symlinks=False)
            except FileNotFoundError:
                st = None
            if st is not None and stat.S_ISLNK(st.st_mode):
                raise linked(at, WHY, HINT)
            if st is None or _ident(st) != self._ids[i + 1]:
                raise SinkError(
                    "was moved or replaced while written in; nothing went outside the sink", path=at
                )

    def lstat(self, name: str) -> os.stat_result | None:
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def open_file(self, name: str) -> int:
        """The regular file `name` opened for reading: a link there is a SymlinkError, anything else but a
        regular file an OSError (EINVAL; a FIFO is never waited on)."""
        return open_regular_at(self.fd, name, self.path / name, WHY, HINT)

    def new_file(self, tmp: str, chunks: Iterable[memoryview]) -> int:
        """Write `chunks` to a new file `tmp` here and fsync it: its size. Removed again on failure."""
        self.unlink(tmp)
        fd = os.open(tmp, _NEW, 0o644, dir_fd=self.fd)
        size = 0
        try:
            try:
                for view in chunks:
                    while view:
                        n = os.write(fd, view)
                        size += n
                        view = view[n:]
                os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException:
            with contextlib.suppress(OSError):  # a full disk: no half-written temp file kept
                self.unlink(tmp)
            raise
        return size

    def write(self, name: str, data: bytes, tmp: str) -> None:
        """Create or replace `name` with `data`: written to `tmp`, fsync'd, renamed over it, made durable."""
        self.new_file(tmp, [memoryview(data)])
        try:
            self.rename(tmp, name)
        except BaseException:
            with contextlib.suppress(OSError):
                self.unlink(tmp)
            raise
        self.fsync()

    def rename(self, src: str, dst: str) -> None:
        os.replace(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def link(self, src: str, dst: str) -> None:
        os.link(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd, follow_symlinks=False)

    def unlink(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self.fd)

    def fsync(self) -> None:
        os.fsync(self.fd)

    def listdir(self) -> list[str]:
        return os.listdir(self.fd)

    def clock(self) -> float:
        """The store's time now: the mtime of a file written here now and removed (on NFS, the server's).
        Its name says whose (`temp_names.py`): a prober of this host killed between the two left its
        file, which goes first."""
        for name in self.listdir():
            m = TEMP_NAME.fullmatch(name) if name.startswith(f".{CLOCK_NAME}.tmp-") else None
            if m is not None and m["host"] == HOST and not pid_alive(int(m["pid"])):
                self.unlink(name)
        probe = temp_name(Path(CLOCK_NAME)).name
        try:
            self.new_file(probe, [])
            crash_point("prune.clock")
            st = self.lstat(probe)
            if st is None:
                raise FileNotFoundError(errno.ENOENT, "was removed while read", str(self.path / probe))
            return st.st_mtime
        finally:
            self.unlink(probe)


def _ident(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


class LocalTree:
    """A file:// sink's root and its keys (`/`-separated, relative to it), reached only through `Held`."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def held(self, rel: str, *, create: bool = False) -> Held:
        """The directory `rel` ("" the root); a part missing is a FileNotFoundError, or made (`create`)."""
        names = [n for n in rel.split("/") if n]
        if ".." in names or "." in names:
            raise SinkError("is not a plain path inside the sink", path=self.root / rel)
        # A root that is a file now (NotADirectoryError, a retried SinkError) passed the start's check
        # (`places.refuse_a_file`): something took the directory's place under the running daemon, as a
        # filesystem unmounted does. Its steps wait for the sink, as in any outage, and go once it is a
        # directory again, none quarantined for what the sink, not the step, is.
        try:
            fds = [os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)]
        except FileNotFoundError:
            _refuse_a_dead_link(self.root)
            if not create:
                raise
            os.makedirs(self.root, exist_ok=True)  # the operator's own path: links in it are theirs
            fds = [os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)]
        try:
            at = self.root
            for name in names:
                at = at / name
                try:
                    fds.append(_open_dir(fds[-1], name, at))
                except FileNotFoundError:
                    if not create:
                        raise
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(name, 0o777, dir_fd=fds[-1])
                    fds.append(_open_dir(fds[-1], name, at))
            return Held(self.root, names, fds)
        except BaseException:
            for fd in reversed(fds):
                os.close(fd)
            raise

    def parent(self, key: str, *, create: bool = False) -> tuple[Held, str]:
        """The directory of `key` held, and `key`'s name in it."""
        rel, _, name = key.rpartition("/")
        if name in ("", ".", ".."):
            raise SinkError("is not a plain path inside the sink", path=self.root / key)
        return self.held(rel, create=create), name

    @contextlib.contextmanager
    def opened(self, key: str) -> Iterator[BinaryIO]:
        """The regular file `key` open for reading (`Held.open_file`); FileNotFoundError if it is not there.
        What was read is the sink's only if its directories are still in place after (`Held.check`)."""
        h, name = self.parent(key)
        with h:
            with os.fdopen(h.open_file(name), "rb") as f:
                yield f
            h.check()

    def read(self, key: str, limit: int | None = None) -> bytes | None:
        """At most `limit` bytes of `key` (None: all), never allocating more than it holds; None if absent."""
        try:
            with self.opened(key) as f:
                return read_bounded(f, limit)
        except FileNotFoundError:
            return None

    def lstat(self, key: str) -> os.stat_result | None:
        try:
            h, name = self.parent(key)
        except FileNotFoundError:
            return None
        with h:
            return h.lstat(name)

    def write(self, key: str, data: bytes, tmp: str) -> None:
        """Create or replace `key` (`Held.write`), its directories made as needed."""
        h, name = self.parent(key, create=True)
        with h:
            h.write(name, data, tmp)
            h.check()

    def delete(self, keys: Iterable[str]) -> None:
        """Delete exactly `keys` (missing ones are fine), one directory held for consecutive keys in it."""
        h: Held | None = None
        at: str | None = None
        try:
            for key in keys:
                rel, _, name = key.rpartition("/")
                if rel != at:
                    if h is not None:
                        h.close()
                    h, at = None, rel
                    with contextlib.suppress(FileNotFoundError):
                        h = self.held(rel)
                if h is not None:
                    h.unlink(name)
                    h.check()
        finally:
            if h is not None:
                h.close()

    def files(self, rel: str, start: str = "") -> Iterator[tuple[int, str, str, os.stat_result]]:
        """Every file under `rel` ("" the root; none if it is absent), depth first: the descriptor of its
        directory, its path relative to `rel`, its name, and its lstat. Only names that start with `start`
        (literally) are listed at the top. A link is listed as itself, except one to a directory, which is
        not entered (nor is any link); a directory that turns into a link while walked is a SymlinkError."""
        try:
            h = self.held(rel)
        except (FileNotFoundError, NotADirectoryError):  # another tool's file there: none of ours under it
            return
        with h:
            for fd, sub, entries in _walk(h.fd, "", h.path, start):
                for name, st in entries:
                    yield fd, f"{sub}{name}", name, st
            h.check()

    def remove_empty_dirs(self, rel: str) -> None:
        """Remove the empty directories under `rel`, and it, deepest first (rmdir, which never follows a
        link and leaves a directory written into again)."""
        try:
            h = self.held(rel)
        except FileNotFoundError:
            return
        with h:
            _rmdirs(h.fd, h.path)
            if h.names:
                with contextlib.suppress(OSError):
                    os.rmdir(h.names[-1], dir_fd=h.fds[-2])


def _refuse_a_dead_link(root: Path) -> None:
    """An OSError, the sink down (retried), where a link on the way to its root leads nowhere: the
    filesystem it leads to is not mounted, or the link is stale. Taken for a directory not made yet, the
    sink would be listed as holding nothing (a fleet node would wait for parts that never come), and a
    publish would fail on a bare FileExistsError (`mkdir` of the link). An OSError, not a SinkError:
    the sink names it by the key it was for (as the fleet tells its exchange's failures apart)."""
    link = next((p for p in [root, *root.parents] if os.path.islink(p) and not os.path.exists(p)), None)
    if link is not None:
        raise OSError(
            f"the link {link} -> {os.readlink(link)} leads nowhere: the sink's filesystem is not mounted, "
            "or the link is stale"
        )


def _walk(
    fd: int, rel: str, path: Path, start: str = ""
) -> Iterator[tuple[int, str, list[tuple[str, os.stat_result]]]]:
    files, dirs = [], []
    with os.scandir(fd) as it:
        for e in it:
            if start and not e.name.startswith(start):
                continue
            try:
                st = e.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    dirs.append(e.name)
                elif not (stat.S_ISLNK(st.st_mode) and e.is_dir()):
                    files.append((e.name, st))
            except FileNotFoundError:
                continue  # deleted while listed
    yield fd, rel, files
    for name in sorted(dirs):
        try:
            sub = _open_dir(fd, name, path / name)
        except FileNotFoundError:
            continue
        try:
            yield from _walk(sub, f"{rel}{name}/", path / name)
        finally:
            os.close(sub)


def _rmdirs(fd: int, path: Path) -> None:
    for name in os.listdir(fd):
        try:
            sub = os.open(name, _DIR, dir_fd=fd)
        except OSError:
            continue  # a file, a link (never entered), or gone
        try:
            _rmdirs(sub, path / name)
        finally:
            os.close(sub)
        with contextlib.suppress(OSError):
            os.rmdir(name, dir_fd=fd)
