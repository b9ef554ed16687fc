"""Find and validate the DCP shards of one checkpoint: names, count, no gaps, every header checked."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from stagerd.contract.safetensors_format import Header, find_shards, read_header
from stagerd.errors import ShardError

# ASCII digits only: `\d` would take other scripts' digits, which no writer puts in a name.
_SHARD_NAME = re.compile(r"shard-([0-9]+)-model-([0-9]+)-of-([0-9]+)\.safetensors")


def scan_shards(src: Path, listed: Iterable[str] | None = None) -> Iterator[Header]:
    """Validated headers of the DCP shards in `src`, read one at a time as they are taken.

    The file names are checked now; each header is read and validated when the iterator reaches it, so a
    planner that drops each header before taking the next never holds two. `listed` are the shard file
    names a commit marker promises; without a marker the shard numbers must run 1..S with no gap, since
    a missing rank's file is otherwise invisible.
    """
    return (read_header(p) for p in shard_paths(src, listed))


def shard_paths(src: Path, listed: Iterable[str] | None = None) -> list[Path]:
    """The DCP shard files of `src`, their names, count and numbering checked (see `scan_shards`)."""
    if not src.is_dir():
        raise ShardError("is not a directory of DCP shards", path=src)
    paths = find_shards(src)
    if listed is not None:
        names = {p.name for p in paths}
        for name in listed:
            if name not in names:
                raise ShardError("shard listed in the commit marker is missing", path=src / name)
        listed_set = set(listed)
        paths = [p for p in paths if p.name in listed_set]
    if not paths:
        raise ShardError("no *.safetensors shards found", path=src)
    shard_ids: set[int] = set()
    counts: set[int] = set()
    for p in paths:
        m = _SHARD_NAME.fullmatch(p.name)
        if m is None:
            raise ShardError(
                "unexpected file name; DCP shards are named shard-XXXXX-model-YYYYY-of-ZZZZZ.safetensors",
                path=p,
            )
        shard_ids.add(int(m.group(1)))
        counts.add(int(m.group(3)))
    if len(counts) > 1:
        raise ShardError(f"shards disagree on the file count (-of-{sorted(counts)}): mixed saves?", path=src)
    if listed is None:
        _check_no_gaps(src, shard_ids)
    return paths


def _check_no_gaps(src: Path, shard_ids: set[int]) -> None:
    """Shard numbers run 1..S. Never a set of every number up to the largest: a file named
    `shard-99999999999999-...` would make one of 10^14 ints."""
    if 0 in shard_ids:
        raise ShardError("shard number 0 is no rank's: DCP numbers its shards from 1", path=src)
    top = max(shard_ids)
    if top == len(shard_ids):
        return
    gaps: list[int] = []
    i = 1
    while len(gaps) < 5 and i < top:  # five are found within len(shard_ids) + 5 numbers
        if i not in shard_ids:
            gaps.append(i)
        i += 1
    raise ShardError(f"shard numbers {gaps} are missing (found {len(shard_ids)} of {top})", path=src)
