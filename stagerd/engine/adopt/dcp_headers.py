"""A FileSystemWriter checkpoint's chosen tensors as the headers `plan()` takes, one data file at a time.

Each `__R_N.distcp` file becomes one `Header` (more when it holds several chunks of one tensor): every
chunk's bytes as an entry at its absolute offset (`data_start` 0), with DCP's offsets of the chunk in its
tensor. From there the chunk table, tiling, views, casts, moves and `compare` are the ones every export
runs. Only the chunks of the tensors asked for are read; nothing else in the files is opened.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from stagerd.contract.adopt.dcp_metadata import DcpChunk, DcpMetadata
from stagerd.contract.header_entries import TensorEntry
from stagerd.contract.safetensors_format import Header
from stagerd.contract.step.reopen import open_held
from stagerd.engine.adopt.torch_record import read_record
from stagerd.errors import DcpFormatError, ShardError, open_failed


@dataclass(frozen=True)
class DcpFileHeader(Header):
    """A header whose DCP offsets come from `.metadata`, not from a safetensors `__metadata__`."""

    offsets: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def dcp_offsets(self) -> dict[str, tuple[int, ...]]:
        return self.offsets


def dcp_headers(
    model_dir: Path, meta: DcpMetadata, keys: Iterable[str], opened: Callable[[str], Path] | None = None
) -> Iterator[Header]:
    """Headers of `keys`' chunks, file by file in name order (each file's records read when reached).
    `opened`: the path each data file (by name) is read by, when it is opened through a held directory."""
    by_file: dict[str, list[tuple[str, DcpChunk]]] = {}
    for key in keys:
        for c in meta.tensors[key].chunks:
            by_file.setdefault(c.file, []).append((key, c))
    for name in sorted(by_file):
        yield from _file_headers(model_dir / name, by_file.pop(name), opened)


def _file_headers(
    path: Path, chunks: list[tuple[str, DcpChunk]], opened: Callable[[str], Path] | None
) -> Iterator[Header]:
    try:
        if opened is not None:
            path = opened(path.name)  # the plan reads the file again by this path: the one opened here
        fd = open_held(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ShardError("a data file .metadata lists is missing", path=path) from None
    except OSError as e:
        raise open_failed(e, path, ShardError) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ShardError("is not a regular file", path=path)
        # One header per round: a tensor with two chunks in this file needs two (names are keys).
        rounds: list[dict[str, TensorEntry]] = []
        offsets: list[dict[str, tuple[int, ...]]] = []
        for key, c in sorted(chunks, key=lambda kc: kc[1].offset):
            if c.offset + c.length > st.st_size:
                raise ShardError(
                    f"tensor {key!r}: its record [{c.offset}, {c.offset + c.length}) runs past the "
                    f"{st.st_size}-byte file (truncated?)",
                    path=path,
                )
            r = read_record(fd, c.offset, c.length, path)
            if tuple(r.shape) != c.sizes:
                raise DcpFormatError(
                    f"tensor {key!r}: its record holds {list(r.shape)}, .metadata says {list(c.sizes)}",
                    path=path,
                )
            i = next((i for i, d in enumerate(rounds) if key not in d), len(rounds))
            if i == len(rounds):
                rounds.append({})
                offsets.append({})
            rounds[i][key] = TensorEntry(key, r.dtype, r.shape, r.begin, r.begin + r.nbytes)
            offsets[i][key] = c.offsets
    finally:
        os.close(fd)
    for entries, offs in zip(rounds, offsets, strict=True):
        yield DcpFileHeader(str(path), st.st_size, 0, entries, offsets=offs)
