"""engine/iov.py: a contiguous source range scattered into equal segments of a buffer by preadv, in
batches of IOV_MAX, a truncated source a named error, a segment outside the buffer refused."""

from __future__ import annotations

import os

import numpy as np
import pytest

from stagerd.engine import iov, limits
from stagerd.errors import ShardError


@pytest.fixture
def src(tmp_path):
    data = np.random.default_rng(2).integers(0, 255, size=4096, dtype=np.uint8).tobytes()
    path = tmp_path / "src.bin"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    yield fd, data, str(path)
    os.close(fd)


@pytest.mark.parametrize("libc", [True, False])
def test_segments_land_at_their_offsets_in_batches(monkeypatch, src, libc):
    fd, data, path = src
    monkeypatch.setattr(limits, "IOV_MAX", 3)
    if not libc:
        monkeypatch.setattr(iov, "_PREADV", None)
    buf = bytearray(1000)
    offsets = [900, 0, 500, 100, 300, 700, 200]  # any order: segment k lands at offsets[k]
    iov.scatter_read(fd, buf, offsets, 64, 1000, path)
    for k, o in enumerate(offsets):
        assert buf[o : o + 64] == data[1000 + 64 * k : 1000 + 64 * (k + 1)]


def test_a_truncated_source_is_a_shard_error(src):
    fd, _, path = src
    with pytest.raises(ShardError, match="ends early"):
        iov.scatter_read(fd, bytearray(1024), [0, 256, 512, 768], 256, 3500, path)


def test_a_segment_outside_the_buffer_is_refused(src):
    fd, _, path = src
    with pytest.raises(ValueError):
        iov.scatter_read(fd, bytearray(100), [0, 50], 64, 0, path)


@pytest.mark.parametrize("libc", [True, False])
def test_runs_of_any_length_land_at_their_offsets_in_batches(monkeypatch, src, libc):
    """A pack's back-to-back source runs: one contiguous range, the k-th `lengths[k]` bytes of it at
    `offsets[k]`."""
    fd, data, path = src
    monkeypatch.setattr(limits, "IOV_MAX", 3)
    if not libc:
        monkeypatch.setattr(iov, "_PREADV", None)
    buf = bytearray(1000)
    offsets, lengths = [900, 0, 500, 100, 300, 700, 200], [64, 8, 100, 1, 0, 200, 50]
    iov.gather_read(fd, buf, offsets, lengths, 1000, path)
    pos = 1000
    for o, n in zip(offsets, lengths, strict=True):
        assert buf[o : o + n] == data[pos : pos + n]
        pos += n


def test_a_truncated_source_under_runs_is_a_shard_error(src):
    fd, _, path = src
    with pytest.raises(ShardError, match="ends early"):
        iov.gather_read(fd, bytearray(1024), [0, 256, 300], [256, 44, 500], 3500, path)
    with pytest.raises(ValueError):
        iov.gather_read(fd, bytearray(100), [0, 50], [10, 51], 0, path)
