"""engine/durability.py: the export drops its own pages behind it (waited on, then `POSIX_FADV_DONTNEED`)
while it runs, so its page cache stays within `limits.DROP_BEHIND` and the pages are reused; the bytes are
the same either way. Shards are written here with numpy (one file per rank, DCP's header metadata), so
no gloo save is needed."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from stagerd.contract.safetensors_format import DCP_SHARDING_INFO_KEY, SAVED_OFFSETS_KEY
from stagerd.engine import limits
from stagerd.engine.consolidate import consolidate_into

MIB = 1 << 20


def write_rank(path: Path, blocks: dict[str, tuple[np.ndarray, tuple[int, ...]]]) -> None:
    """A DCP HF shard: each block with its global offset in `__metadata__`."""
    info = {name: {SAVED_OFFSETS_KEY: list(at)} for name, (_, at) in blocks.items()}
    head: dict[str, object] = {"__metadata__": {DCP_SHARDING_INFO_KEY: json.dumps(info)}}
    pos = 0
    for name, (a, _) in blocks.items():
        head[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [pos, pos + a.nbytes]}
        pos += a.nbytes
    raw = json.dumps(head).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for a, _ in blocks.values():
            f.write(np.ascontiguousarray(a).tobytes())


def resident_pages(path: Path) -> int:
    """Pages of `path` in the page cache (mincore on a private mapping, which shares the cached pages)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    size = path.stat().st_size
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
        n = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * n)()
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) == 0, ctypes.get_errno()
        resident = sum(v & 1 for v in vec)
        del addr
    return resident


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    """24 MiB over 2 ranks: a Shard(0) tensor (copies) and a Shard(1) one (gathers)."""
    g = np.random.default_rng(0)
    full = {
        "a.weight": g.standard_normal((1536, 2048), dtype=np.float32),
        "b.weight": g.standard_normal((1536, 2048), dtype=np.float32),
    }
    src = tmp_path_factory.mktemp("drop") / "shards"
    src.mkdir()
    for r in range(2):
        a, b = full["a.weight"], full["b.weight"]
        blocks = {
            "a.weight": (a[r * 768 : (r + 1) * 768], (r * 768, 0)),
            "b.weight": (b[:, r * 1024 : (r + 1) * 1024], (0, r * 1024)),
        }
        write_rank(src / f"shard-0000{r + 1}-model-00001-of-00001.safetensors", blocks)
    return src, full


@pytest.mark.parametrize("window", [2 * MIB, 0])
def test_the_export_drops_its_pages_behind_it_and_keeps_every_byte(tmp_path, monkeypatch, shards, window):
    src, full = shards
    monkeypatch.setattr(limits, "DROP_BEHIND", window)
    monkeypatch.setattr(limits, "COPY_PIECE", MIB)  # many moves, so the written prefix grows in steps
    dropped: list[tuple[int, int]] = []
    fadvise = os.posix_fadvise

    def spy(fd: int, offset: int, length: int, advice: int) -> None:
        dropped.append((offset, length))
        fadvise(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    consolidate_into(src, tmp_path, threads=2)
    (out,) = tmp_path.glob("*.safetensors")
    resident = resident_pages(out)  # before the reads below bring the file back
    got = load_file(out)
    for name, want in full.items():
        assert np.array_equal(got[name], want), name
    if window:
        during = [(o, n) for o, n in dropped if n]  # ranges dropped while moves still ran
        assert during and all(o % (2 * MIB) == 0 and n >= window for o, n in during)
        assert resident == 0  # and the rest once the file was fsynced
    else:
        assert dropped == [] and resident > 0
