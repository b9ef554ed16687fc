"""A step directory held open: every write and delete in it made from that handle, not by its path.

A step directory checked to be real (`refuse_links`) may be replaced by a symbolic link (or
have its `export.tmp/` replaced) a moment later: a by-path `mkdir`, `rmtree` or `rename` would then write
or delete wherever the link leads. `HeldDir` opens the directory with O_NOFOLLOW (a link is a SymlinkError)
and makes every change relative to that descriptor, so it lands in that very directory whatever is put at
its path meanwhile. A library that needs a path gets `proc` (`/proc/self/fd/N`, which the kernel resolves
to the held directory itself); errors are named by the real path again (`naming`). `replaced` tells whether
the path still names the held directory, so that nothing is committed into a step that is no longer there.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
import shutil
import stat
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from stagerd.contract.regular_file import is_link_at, linked, open_regular_at
from stagerd.contract.step.reopen import Closed, closed, give, park, reopen, take, unpark
from stagerd.errors import StagerdError
from stagerd.ops.fdlimit import raise_open_files_limit

WHY = "the daemon journaled a real directory here and never reads, writes or deletes through a link"
HINT = "replace the link by the real directory it stands for (its target was left as it is), then retry"
_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_PROC_FD = re.compile(r"/proc/self/fd/([0-9]+)(?![0-9])")


class HeldDir:
    """An open directory (see the module): `path` names it in messages, `fd` and `proc` reach it."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, why: str = WHY, hint: str = HINT) -> HeldDir:
        """Hold `path`; SymlinkError if it is a link, FileNotFoundError if it is gone."""
        return cls._open(Path(path), path, None, why, hint)

    def child(self, name: str, *, why: str = WHY, hint: str = HINT) -> HeldDir:
        """Hold the directory `name` in this one, refusing a link there."""
        return self._open(self.path / name, name, self.fd, why, hint)

    @classmethod
    def _open(
        cls, path: Path, name: str | os.PathLike[str], dir_fd: int | None, why: str, hint: str
    ) -> HeldDir:
        try:
            return cls(path, os.open(name, _FLAGS, dir_fd=dir_fd))
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR) and is_link_at(name, dir_fd):
                raise linked(path, why, hint) from None
            raise

    @property
    def proc(self) -> Path:
        return Path(f"/proc/self/fd/{self.fd}")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> HeldDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def lexists(self, name: str) -> bool:
        try:
            os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def names(self) -> list[str]:
        return sorted(os.listdir(self.fd))

    def mkdir(self, name: str) -> None:
        os.mkdir(name, dir_fd=self.fd)

    def rmtree(self, name: str, *, why: str = WHY, hint: str = HINT) -> None:
        """Remove `name` and what is under it; a link there is refused, its target untouched (shutil's
        fd-based rmtree opens each directory it enters without following links)."""
        if is_link_at(name, self.fd):
            raise linked(self.path / name, why, hint)
        shutil.rmtree(name, dir_fd=self.fd)

    def clear(self) -> None:
        """Remove everything in the held directory, which stays (empty) wherever it now is."""
        for name in os.listdir(self.fd):
            if stat.S_ISDIR(os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_mode):
                shutil.rmtree(name, dir_fd=self.fd)
            else:
                os.unlink(name, dir_fd=self.fd)

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def fsync(self) -> None:
        os.fsync(self.fd)

    def holds(self, name: str, other: HeldDir) -> bool:
        """Whether `name` in this directory is (still) the directory `other` holds, not a link."""
        try:
            st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return os.path.samestat(st, os.fstat(other.fd))

    def replaced(self) -> bool:
        """Whether `path` no longer names the held directory (moved, deleted, or a link put there)."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return True
        return not os.path.samestat(st, os.fstat(self.fd))

    def real(self, text: str) -> str:
        """`text` with this handle's `proc` path put back as the real one."""
        return re.sub(re.escape(str(self.proc)) + r"(?![0-9])", lambda _: str(self.path), text)

    def naming(self) -> contextlib.AbstractContextManager[None]:
        """Errors raised inside name the real path, not `proc`."""
        return renaming(self.real)

    def open_file(self, name: str, *, why: str = WHY, hint: str = HINT) -> int:
        """The file `name` in this directory opened for reading, refusing a link there (SymlinkError); an
        OSError (EINVAL) if it is not a regular file (a FIFO is opened without waiting on a writer)."""
        return open_regular_at(self.fd, name, self.path / name, why, hint)


class HeldFiles:
    """Files and directories opened through held directories without following a link, each reached by
    its `/proc/self/fd/N` path (the kernel opens that very file again, whatever is put at its name since)
    until `close`; `naming` puts their real paths back in errors.

    A file opened `bounded` (a step's shards and raw files: as many as it has ranks) stays open only while
    every holder's together fit the process's budget (`reopen.take`); beyond it, it is closed once its
    identity is noted and named by a path only `reopen.open_held` (or `reading`) opens: through the held
    directory, without following a link, and only if it is the same file."""

    def __init__(self) -> None:
        _room()
        self._fds: dict[Path, int] = {}  # the real path of each: opened once, however often it is read
        self._real: dict[str, str] = {}
        self._at: dict[Path, tuple[int, str]] = {}  # the directory each was opened from, and its name there
        self._closed: dict[Path, Closed] = {}  # the bounded ones beyond the budget
        self._taken = 0

    def open(
        self, where: HeldDir, name: str, *, why: str = WHY, hint: str = HINT, bounded: bool = False
    ) -> Path:
        """The `/proc/self/fd/N` path of the file `name` in `where` (see `HeldDir.open_file`); `bounded`
        (see the class), that of a closed one beyond the budget."""
        real = where.path / name
        if bounded and real in self._closed:
            return self._closed[real].path
        if real not in self._fds:  # (one asked for unbounded is held, closed before or not)
            fd = where.open_file(name, why=why, hint=hint)
            if bounded and not take():
                try:
                    st = os.fstat(fd)
                finally:
                    os.close(fd)
                self._closed[real] = c = park(where.fd, name, real, st)
                return c.path
            self._taken += bounded
            self._add(real, fd, where, name)
        return Path(f"/proc/self/fd/{self._fds[real]}")

    def hold(self, where: HeldDir, name: str, *, why: str = WHY, hint: str = HINT) -> HeldDir:
        """The directory `name` in `where`, held (see `HeldDir.child`) until `close`."""
        real = where.path / name
        if real not in self._fds:
            self._add(real, where.child(name, why=why, hint=hint).fd, where, name)
        return HeldDir(real, self._fds[real])

    def hold_at(self, where: HeldDir, rel: str, *, why: str = WHY, hint: str = HINT) -> HeldDir:
        """The directory at the relative path `rel` under `where`, each one on the way held from its
        parent (see `hold`)."""
        for name in rel.split("/"):
            where = self.hold(where, name, why=why, hint=hint)
        return where

    def open_at(
        self, where: HeldDir, rel: str, *, why: str = WHY, hint: str = HINT, bounded: bool = False
    ) -> Path:
        """The path of the file at the relative path `rel` under `where`, each directory on the way held
        from its parent (see `hold_at`, `open`)."""
        parent, _, name = rel.rpartition("/")
        if parent:
            where = self.hold_at(where, parent, why=why, hint=hint)
        return self.open(where, name, why=why, hint=hint, bounded=bounded)

    def _add(self, real: Path, fd: int, where: HeldDir, name: str) -> None:
        self._fds[real] = fd
        self._real[str(fd)] = str(real)
        self._at[real] = (where.fd, name)

    def replaced(self) -> Path | None:
        """The first of them whose name no longer names it (moved, deleted, or a link put there), while
        the directories they were opened from are held; None when every one is still in its place."""
        ids = [(r, d, n, _dev_ino(os.fstat(self._fds[r]))) for r, (d, n) in self._at.items()]
        ids += [(r, c.dir_fd, c.name, c.ident[:2]) for r, c in self._closed.items()]
        for real, d, name, ident in ids:
            try:
                now = os.stat(name, dir_fd=d, follow_symlinks=False)
            except FileNotFoundError:
                return real
            if _dev_ino(now) != ident:
                return real
        return None

    def real(self, text: str) -> str:
        return _PROC_FD.sub(lambda m: self._real.get(m[1], m[0]), text)

    def naming(self) -> contextlib.AbstractContextManager[None]:
        return renaming(self.real)

    def close(self) -> None:
        for c in self._closed.values():
            unpark(c)
        give(self._taken)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._real.clear()
        self._at.clear()
        self._closed.clear()
        self._taken = 0

    def __enter__(self) -> HeldFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _dev_ino(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


@contextlib.contextmanager
def reading(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A path by which the input `path` may be opened by name inside the block: itself, or for a closed
    one (`reopen`) the proc path of that file opened again, named by its real path in errors."""
    c = closed(path)
    if c is None:
        yield Path(path)
        return
    try:
        fd = reopen(c)
    except OSError as e:  # out of descriptors: named by the file's real path
        e.filename = str(c.real)
        raise
    proc = f"/proc/self/fd/{fd}"
    try:
        with renaming(lambda text: re.sub(re.escape(proc) + r"(?![0-9])", lambda _: str(c.real), text)):
            yield Path(proc)
    finally:
        os.close(fd)


@functools.cache
def _room() -> None:
    """Once: the files of a step are held until its export or publish ends (and the export opens each
    again while it copies), more than a soft limit of 1,024 allows for a large world's step."""
    raise_open_files_limit()


@contextlib.contextmanager
def renaming(real: Callable[[str], str]) -> Iterator[None]:
    """Errors raised inside have `real` applied to their message and path (proc paths named again)."""
    try:
        yield
    except StagerdError as e:
        e.message = real(e.message)
        e.args = (e.message, *e.args[1:])
        if e.path is not None:
            e.path = real(e.path)
        raise
    except OSError as e:
        if isinstance(e.filename, str):
            e.filename = real(e.filename)
        raise


def refuse_links(
    directory: str | os.PathLike[str], parts: Iterable[str] = (), *, why: str, hint: str
) -> bool:
    """`SymlinkError` if `directory` or any of `parts` (names in it) that exists is a symbolic link; True
    when the directory is there and real, False when it is gone (its caller names that its own way). Each
    part is looked at from the directory's own descriptor, so it is one of that very directory."""
    try:
        held = HeldDir.open(directory, why=why, hint=hint)
    except FileNotFoundError:
        return False
    with held:
        for part in parts:
            if is_link_at(part, held.fd):
                raise linked(held.path / part, why, hint)
    return True


@contextlib.contextmanager
def held_child(path: Path) -> Iterator[HeldDir]:
    """The directory `path` held through its parent (a step's `export/` through the step), neither opened
    through a link: what is read through it stays the directory that was checked."""
    with HeldDir.open(path.parent) as parent, parent.child(path.name) as held:
        yield held
