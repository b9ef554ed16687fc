"""Find and validate the DCP shards of one checkpoint: names, count, no gaps, every header checked."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from stagerd.contract.safetensors_format import Header, find_shards, read_header
from stagerd.errors import ShardError

_SHARD_NAME = re.compile(r"^shard-(\d+)-model-(\d+)-of-(\d+)\.safetensors$")


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
        m = _SHARD_NAME.match(p.name)
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
        gaps = sorted(set(range(1, max(shard_ids) + 1)) - shard_ids)
        if gaps:
            raise ShardError(
                f"shard numbers {gaps[:5]} are missing (found {len(shard_ids)} of {max(shard_ids)})", path=src
            )
    return paths
