"""engine/strided.py and its C kernel `_tiles.copy2d`: strided blocks read within the buffer (whole spans,
bands, packed runs, pieces of one run) and placed tile-wise, byte for byte what numpy's transpose gives,
for every item size, with and without the compiled kernel."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from stagerd.engine import strided
from stagerd.engine.plan_types import Piece
from stagerd.errors import ShardError


def run_piece(tmp_path, src: np.ndarray, perm: tuple[int, ...], box: tuple[tuple[int, int], ...], room: int):
    """Read box `box` of `src.transpose(perm)` from a file holding `src` (row-major) and place it into a
    row-major slab of the box's shape, as the runner does; returns the slab and the read sizes."""
    path = tmp_path / "src.bin"
    path.write_bytes(src.tobytes())
    isz = src.itemsize
    view = src.transpose(perm)
    byte_strides = tuple(view.strides)
    start = sum(lo * s for (lo, _), s in zip(box, byte_strides, strict=True))
    shape = tuple(hi - lo for lo, hi in box)
    span = sum((n - 1) * s for n, s in zip(shape, byte_strides, strict=True)) + isz
    pc = Piece(0, start, span, box, byte_strides)
    slab = bytearray(math.prod(shape) * isz)
    slab_strides = [int(s) for s in np.empty(shape, dtype=src.dtype).strides]
    scratch = memoryview(bytearray(room))
    reads = []
    fd = os.open(path, os.O_RDONLY)
    try:
        for r in strided.read_piece(fd, str(path), pc, isz, scratch):
            reads.append(r)
            at = sum(i * s for i, s in zip(r.at, slab_strides, strict=True))
            strided.place(memoryview(slab), at, slab_strides, scratch, r.offset, r.strides, r.shape, isz)
    finally:
        os.close(fd)
    got = np.frombuffer(slab, dtype=src.dtype).reshape(shape)
    want = view[tuple(slice(lo, hi) for lo, hi in box)]
    return got, want, reads


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
@pytest.mark.parametrize(
    ("room", "min_run", "path"),
    [(1 << 20, 512, "span"), (4096, 512, "bands"), (1 << 20, 4, "runs"), (16, 4, "pieces of a run")],
)
def test_a_transposed_block_is_read_within_the_buffer_and_placed_exactly(
    tmp_path, monkeypatch, compiled, dtype, room, min_run, path
):
    if not compiled:
        monkeypatch.setattr(strided, "_tiles", None)
    elif strided._tiles is None:
        pytest.skip("the _tiles extension is not built")
    monkeypatch.setattr(strided, "MIN_RUN", min_run)
    src = np.random.default_rng(1).integers(0, 255, size=(3, 37, 70)).astype(dtype)
    # a slab's worth: rows 5..12 of the transposed [3, 70, 37] block (a thin strip of every source row)
    box = ((0, 3), (5, 12), (0, 37))
    got, want, reads = run_piece(tmp_path, src, (0, 2, 1), box, room)
    assert np.array_equal(got, want)
    if path == "span":
        assert len(reads) == 1
    elif path == "runs":
        assert len(reads) == 1 and reads[0].strides[2] != src.strides[1]  # packed, not the source's
    else:
        assert len(reads) > 1


def test_a_plain_strided_box_and_a_single_element_are_placed(tmp_path):
    src = np.arange(2 * 9 * 11, dtype=np.uint32).reshape(2, 9, 11)
    got, want, _ = run_piece(tmp_path, src, (0, 1, 2), ((1, 2), (2, 7), (3, 10)), 1 << 16)
    assert np.array_equal(got, want)
    got, want, _ = run_piece(tmp_path, src, (0, 2, 1), ((1, 2), (4, 5), (6, 7)), 1 << 16)
    assert np.array_equal(got, want)


@pytest.mark.skipif(strided._tiles is None, reason="the _tiles extension is not built")
def test_the_kernels_refuse_what_does_not_fit_their_buffers():
    src, dst = bytearray(64), bytearray(64)
    strided._tiles.copy2d(src, 0, 4, 16, dst, 0, 16, 4, 4, 4, 4)  # 4 x 4 of 4 bytes: fits both
    with pytest.raises(ValueError):
        strided._tiles.copy2d(src, 4, 4, 16, dst, 0, 16, 4, 4, 4, 4)
    with pytest.raises(ValueError):
        strided._tiles.copy2d(src, 0, 4, 16, dst, 0, 17, 4, 4, 4, 4)
    with pytest.raises(ValueError):
        strided._tiles.copy2d(src, 0, -4, 16, dst, 0, 16, 4, 4, 4, 4)
    with pytest.raises(ValueError):  # three runs of 32 bytes into 64
        strided._tiles.read_runs(0, dst, np.zeros(3, dtype=np.int64).tobytes(), 32)


@pytest.mark.parametrize("compiled", [True, False])
def test_a_source_cut_short_under_a_packed_read_is_a_shard_error(tmp_path, monkeypatch, compiled):
    if not compiled:
        monkeypatch.setattr(strided, "_tiles", None)
    elif strided._tiles is None:
        pytest.skip("the _tiles extension is not built")
    monkeypatch.setattr(strided, "MIN_RUN", 4)
    src = np.arange(3 * 37 * 70, dtype=np.uint32).reshape(3, 37, 70)
    path = tmp_path / "src.bin"
    path.write_bytes(src.tobytes()[: src.nbytes // 2])  # the file ends halfway through the block
    view = src.transpose(0, 2, 1)
    box = ((0, 3), (5, 12), (0, 37))
    pc = Piece(0, 5 * 4, src.nbytes - 5 * 4, box, tuple(view.strides))
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(ShardError, match="ends early"):
            list(strided.read_piece(fd, str(path), pc, 4, memoryview(bytearray(1 << 20))))
    finally:
        os.close(fd)
