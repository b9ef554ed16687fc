"""Walking an export directory: the one walk that the engine, the fsspec sinks and the Hub sink share.

Each caller applies its own policy to what the walk yields (the Hub refuses links and empty exports, the
fsspec sinks skip a manifest); the walk itself is the same everywhere: no directory link is followed,
names are relative and `/`-separated, and the order is sorted by name.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path


def walk_entries(
    root: Path, *, skip_top_dirs: frozenset[str] | set[str] = frozenset()
) -> Iterator[tuple[str, Path]]:
    """(relative name, path) of every file, and of every link to a directory, under `root`, sorted by name.

    Links to directories are yielded, not entered, so that a caller can refuse them; `skip_top_dirs`
    names directories directly under `root` that are not entered.
    """
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        here = Path(dirpath)
        if here == root:
            dirnames[:] = [d for d in dirnames if d not in skip_top_dirs]
        linked = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
        for name in [*filenames, *linked]:
            path = here / name
            found.append((path.relative_to(root).as_posix(), path))
    found.sort(key=lambda entry: entry[0])
    yield from found


def regular_files(root: Path) -> tuple[tuple[str, int], ...]:
    """(relative name, size) of every regular file under `root` (links followed to their target), sorted."""
    return tuple((rel, path.stat().st_size) for rel, path in walk_entries(root) if path.is_file())
