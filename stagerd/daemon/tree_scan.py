"""`--adopt`: whether a trainer's checkpoint is being written, at a bounded cost per scan however many files
it holds.

A checkpoint can hold thousands of files (a DCP shard and an RNG state per rank), and the scan runs up to
every 0.1 s while an export runs: a walk of every entry each time would cost the disk's metadata what the
yield means to spare it. So each checkpoint's entries are remembered (`Tree`), and one scan stats:

- each remembered directory (at most `DIRS_PER_SCAN`, in turn beyond that): a file created, renamed or
  deleted changes its directory's mtime, so a directory is listed again only once its mtime changed (at
  most every `RELIST_SECONDS`: meanwhile that fresh mtime already says "written"), and listings stop once
  a scan has listed `LIST_ENTRIES` entries; a directory a listing finds is stat'ed (and listed) in the
  same scan, so a small checkpoint is walked whole by its first scan;
- the entries found written within the window at their last stat (a file being written is stat'ed every
  scan until it goes quiet), then the files a listing found new;
- and the next of the rest in turn, `stats` in all, so a file written in place (its directory's mtime
  unchanged) is seen within `entries / stats` scans (5,000 entries at 256: 20 scans, 2 s at one per 0.1 s).

Links are never followed: directories are opened with `O_NOFOLLOW` and entries stat'ed without following
(a directory replaced by a link since its listing is dropped at its next stat).
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

DIRS_PER_SCAN = 64
LIST_ENTRIES = 4096
RELIST_SECONDS = 1.0
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Tree:
    """One checkpoint directory's entries as last listed, and which of them were written lately."""

    def __init__(self, ident: tuple[int, int]) -> None:
        self.ident = ident  # (st_dev, st_ino) of the checkpoint: the same name made again starts afresh
        self.dirs: dict[str, int] = {"": -1}  # relative path ("" the top) -> st_mtime_ns when listed
        self.listed_at: dict[str, float] = {}
        self.kids: dict[str, list[str]] = {}  # directory -> its entries' relative paths
        self.files: list[str] = []  # every entry but directories, the rotation's order
        self.fresh: list[str] = []  # entries a listing found new in an already listed directory
        self.hot: dict[str, float] = {}  # entry -> mtime, those not older than the window at their stat
        self._dir_pos = self._pos = 0
        self._stale = False  # `files` to rebuild from `kids`

    def scan(self, fd: int, lo: float, hi: float, stats: int) -> float | None:
        """The newest mtime in [lo, hi] known of the tree under the open directory `fd` after this scan's
        stats (`stats` of files, besides its directories'), or None."""
        self._scan_dirs(fd, lo)
        if self._stale:
            self.files = [p for kids in self.kids.values() for p in kids if p not in self.dirs]
            self._stale = False
        batch = [p for p in self.hot if p not in self.dirs][:stats]
        while self.fresh and len(batch) < stats:
            batch.append(self.fresh.pop())
        n = min(len(self.files), stats - len(batch))
        if n > 0:
            start = self._pos % len(self.files)
            batch += self.files[start : start + n] + self.files[: max(0, start + n - len(self.files))]
            self._pos = start + n
        for p in batch:
            try:
                m = os.stat(p, dir_fd=fd, follow_symlinks=False).st_mtime
            except OSError:
                self.hot.pop(p, None)  # gone: its directory's listing drops it
                continue
            self._note(p, m, lo)
        for p in [p for p, m in self.hot.items() if m < lo]:
            del self.hot[p]
        return max((m for m in self.hot.values() if lo <= m <= hi), default=None)

    def _note(self, p: str, m: float, lo: float) -> None:
        if m >= lo:
            self.hot[p] = m
        else:
            self.hot.pop(p, None)

    def _scan_dirs(self, fd: int, lo: float) -> None:
        names = list(self.dirs)
        if len(names) > DIRS_PER_SCAN:
            start = self._dir_pos % len(names)
            names = (names[start:] + names[:start])[:DIRS_PER_SCAN]
            self._dir_pos = start + DIRS_PER_SCAN
        listed, now, i = 0, time.monotonic(), 0
        while i < len(names) and i < DIRS_PER_SCAN:
            d, i = names[i], i + 1
            if d not in self.dirs:
                continue  # dropped with a parent this scan
            try:
                st = os.fstat(fd) if not d else os.stat(d, dir_fd=fd, follow_symlinks=False)
            except OSError:
                self._drop(d)
                continue
            if not stat.S_ISDIR(st.st_mode):
                self._drop(d)
                continue
            self._note(d, st.st_mtime, lo)
            listed = self.dirs[d]
            was = self.dirs[d]
            if was == st.st_mtime_ns or listed >= LIST_ENTRIES:
                continue
            if was >= 0 and now - self.listed_at.get(d, -RELIST_SECONDS) < RELIST_SECONDS:
                continue
            found = self._list(fd, d, st.st_mtime_ns, known=was >= 0)
            listed += len(self.kids.get(d, ()))
            names += found
            self.listed_at[d] = now

    def _list(self, fd: int, d: str, mtime_ns: int, *, known: bool) -> list[str]:
        """List `d` again; the directories it holds that were not known."""
        try:
            sub = os.open(d or ".", _DIR_FLAGS, dir_fd=fd)
        except OSError:
            self._drop(d)
            return []
        try:
            with os.scandir(sub) as it:
                entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
        except OSError:
            self._drop(d)
            return []
        finally:
            os.close(sub)
        old = set(self.kids.get(d, ()))
        kids, found = [], []
        for name, is_dir in entries:
            p = f"{d}/{name}" if d else name
            kids.append(p)
            if is_dir and p not in self.dirs:
                self.dirs[p] = -1
                found.append(p)
            if p not in old and not is_dir and known:
                self.fresh.append(p)
        for gone in old.difference(kids):
            self._drop(gone)
        self.kids[d] = kids
        self.dirs[d] = mtime_ns  # the mtime stat'ed before the listing: a change meanwhile lists it again
        self._stale = True
        return found

    def _drop(self, p: str) -> None:
        """Forget `p` and, a directory, everything under it (the top itself only forgets its entries)."""
        self.hot.pop(p, None)
        for kid in self.kids.pop(p, ()):
            self._drop(kid)
        if p:
            self.dirs.pop(p, None)
            self.listed_at.pop(p, None)
        else:
            self.dirs[p] = -1
        self._stale = True


class Trees:
    """The remembered `Tree` of each checkpoint a scan walks; any other is forgotten."""

    def __init__(self) -> None:
        self._trees: dict[Path, Tree] = {}

    def newest(self, ckpts: list[Path], lo: float, hi: float, stats: int) -> dict[Path, float]:
        """Checkpoint -> the newest mtime in [lo, hi] under it, of those written within it; `stats` file
        stats in all, shared among `ckpts`."""
        out: dict[Path, float] = {}
        each = max(32, stats // max(1, len(ckpts)))
        for d in ckpts:
            try:
                fd = os.open(d, _DIR_FLAGS)
            except OSError:
                self._trees.pop(d, None)
                continue
            try:
                st = os.fstat(fd)
                ident = (st.st_dev, st.st_ino)
                tree = self._trees.get(d)
                if tree is None or tree.ident != ident:
                    tree = self._trees[d] = Tree(ident)
                m = tree.scan(fd, lo, hi, each)
            finally:
                os.close(fd)
            if m is not None:
                out[d] = m
        for gone in set(self._trees).difference(ckpts):
            del self._trees[gone]
        return out
