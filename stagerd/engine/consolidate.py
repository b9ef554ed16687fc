"""DCP shards -> HF safetensors: `plan()` turns validated headers into byte moves, `execute()` does them.

The plan is frozen before a byte moves, and both the file headers and the index are derived from it, so the
index can never disagree with the files. Moves come in three kinds:

- `copy`: a contiguous source run to a contiguous destination run, same dtype: `os.copy_file_range`,
  which stays in the kernel.
- `cast`: the same, through bounded buffers and torch's own conversion kernel (bit-exact with `.to`).
- `gather`: a slab of a tensor whose chunks are strided in the output (e.g. `Shard(1)`): each chunk's
  rows are read with `pread` into one bounded buffer, placed with numpy, cast if asked, written with one
  `pwrite`.

Memory is a fixed set of per-thread buffers: it does not grow with the model or its largest tensor.
"""

from __future__ import annotations

import bisect
import errno
import math
import os
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from stagerd.contract import dtypes
from stagerd.contract.layout import INDEX_NAME, TensorInfo
from stagerd.contract.safetensors_format import Header, encode_header, find_shards, read_header
from stagerd.contract.sharding import (
    DEFAULT_MAX_SHARD_SIZE,
    assign_with_reference,
    natural_key,
    output_file_names,
    pack_by_size,
)
from stagerd.errors import DTypeError, OutputError, PlanError, ShardError

ProgressFn = Callable[[int, int], None]

COPY_PIECE = 64 << 20  # split big copies so threads share the work evenly
BUFFER_BYTES = 8 << 20  # per-thread cast / gather buffer
DIRECT_MIN_RUN = 1 << 20  # strided runs at least this long are copied run by run instead of gathered
MAX_GRID_CELLS = 1 << 22
SCATTER_MIN_SEGMENT = 512  # gather segments at least this long are read in place with preadv
IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024)
_SHARD_NAME = re.compile(r"^shard-(\d+)-model-(\d+)-of-(\d+)\.safetensors$")


@dataclass(frozen=True)
class Chunk:
    """One block of a tensor in one source shard."""

    src: int
    offset: int  # absolute byte offset of the block in the source file
    global_offset: tuple[int, ...]
    shape: tuple[int, ...]


@dataclass(frozen=True)
class TensorPlan:
    """Where one tensor comes from and where it goes. `begin`/`end` are relative to the data section."""

    name: str
    src_dtype: str
    dst_dtype: str
    shape: tuple[int, ...]
    file: int
    begin: int
    end: int
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class Piece:
    """Part of a gather: `length` contiguous source bytes, placed at `box` ([start, stop) per dim)."""

    src: int
    src_offset: int
    length: int
    box: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Move:
    """One unit of work. `dst_offset` is absolute in the output file; `length` counts destination bytes."""

    kind: str  # "copy" | "cast" | "gather"
    file: int
    dst_offset: int
    length: int
    src: int = -1
    src_offset: int = 0
    src_dtype: str = ""
    dst_dtype: str = ""
    slab_shape: tuple[int, ...] = ()
    pieces: tuple[Piece, ...] = ()


@dataclass(frozen=True)
class OutputFile:
    name: str
    header: bytes
    size: int
    tensors: tuple[str, ...]


@dataclass(frozen=True)
class ExportPlan:
    """Everything `execute` needs, decided up front."""

    sources: tuple[str, ...]
    files: tuple[OutputFile, ...]
    tensors: tuple[TensorPlan, ...]
    moves: tuple[Move, ...]
    total_size: int = field(default=0)

    def index(self) -> dict[str, object]:
        """`model.safetensors.index.json`, derived from the same plan as the headers."""
        weight_map = {
            t.name: self.files[t.file].name for t in sorted(self.tensors, key=lambda t: natural_key(t.name))
        }
        return {"metadata": {"total_size": self.total_size}, "weight_map": weight_map}

    @property
    def bytes_to_write(self) -> int:
        return sum(m.length for m in self.moves)


# ---------------------------------------------------------------------------------------------- inputs


def scan_shards(src: Path, listed: Iterable[str] | None = None) -> list[Header]:
    """Validated headers of the DCP shards in `src`.

    `listed` are the shard file names a commit marker promises; without a marker the shard numbers
    must run 1..S with no gap, since a missing rank's file is otherwise invisible.
    """
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
    return [read_header(p) for p in paths]


# ---------------------------------------------------------------------------------------------- planning


def _strides(shape: Sequence[int]) -> list[int]:
    out = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        out[d] = out[d + 1] * shape[d + 1]
    return out


def _check_tiling(name: str, shape: tuple[int, ...], chunks: Sequence[Chunk], where: str) -> None:
    """The chunks cover the tensor exactly once: no gap, no overlap, nothing out of bounds."""
    live = [c for c in chunks if math.prod(c.shape) > 0]
    for c in live:
        for d, (o, n, g) in enumerate(zip(c.global_offset, c.shape, shape, strict=True)):
            if o + n > g:
                raise PlanError(
                    f"tensor {name!r}: chunk at {list(c.global_offset)} runs past dim {d} ({g})", path=where
                )
    total = math.prod(shape)
    covered = sum(math.prod(c.shape) for c in live)
    if covered != total:
        kind = "overlap" if covered > total else "do not cover it (a shard is missing?)"
        raise PlanError(
            f"tensor {name!r}{list(shape)}: its chunks {kind}: {covered} of {total} elements", path=where
        )
    if len(live) <= 1:
        return
    bounds = [
        sorted({0, g, *(c.global_offset[d] for c in live), *(c.global_offset[d] + c.shape[d] for c in live)})
        for d, g in enumerate(shape)
    ]
    cells = math.prod(len(b) - 1 for b in bounds)
    if cells <= MAX_GRID_CELLS:
        import numpy as np

        grid = np.zeros([len(b) - 1 for b in bounds], dtype=np.int32)
        for c in live:
            sl = tuple(
                slice(bisect.bisect_left(b, o), bisect.bisect_left(b, o + n))
                for b, o, n in zip(bounds, c.global_offset, c.shape, strict=True)
            )
            grid[sl] += 1
        if (grid > 1).any():
            raise PlanError(f"tensor {name!r}: chunks overlap", path=where)
        return
    for i, a in enumerate(live):  # pathological non-grid tilings only
        for b in live[i + 1 :]:
            if all(
                oa < ob + nb and ob < oa + na
                for oa, na, ob, nb in zip(a.global_offset, a.shape, b.global_offset, b.shape, strict=True)
            ):
                raise PlanError(f"tensor {name!r}: chunks overlap", path=where)


def _runs(chunk: Chunk, shape: tuple[int, ...]) -> tuple[int, int]:
    """(number of contiguous destination runs, elements per run) of a chunk."""
    n = len(shape)
    k = -1
    for d in range(n - 1, -1, -1):
        if chunk.shape[d] != shape[d]:
            k = d
            break
    if k <= 0 or all(chunk.shape[d] == 1 for d in range(k)):
        return 1, math.prod(chunk.shape)
    return math.prod(chunk.shape[:k]), math.prod(chunk.shape[k:])


def _out_dtype(name: str, src: str, target: str | None, keep: re.Pattern[str] | None) -> str:
    if target is None or not dtypes.lookup(src).castable or (keep is not None and keep.search(name)):
        return src
    return target


def _tensor_moves(t: TensorPlan, data_start: int, src_headers: Sequence[Header]) -> list[Move]:
    sdt, ddt = dtypes.lookup(t.src_dtype), dtypes.lookup(t.dst_dtype)
    dst_base = data_start + t.begin
    runs = [(c, *_runs(c, t.shape)) for c in t.chunks if math.prod(c.shape) > 0]
    if sdt.bits % 8 and any(r > 1 for _, r, _ in runs):
        raise PlanError(
            f"tensor {t.name!r}: {t.src_dtype} split inside its rows is not byte-addressable",
            path=src_headers[0].path,
        )
    direct = all(r == 1 or ln * max(sdt.bits, ddt.bits) // 8 >= DIRECT_MIN_RUN for _, r, ln in runs)
    moves: list[Move] = []
    if direct:
        gstrides = _strides(t.shape)
        for c, nruns, ln in runs:
            k = len(t.shape) - 1
            while k > 0 and c.shape[k] == t.shape[k]:
                k -= 1
            outer = c.shape[:k] if nruns > 1 else ()
            for i, idx in enumerate(_ndindex(outer)):
                dst_elem = sum(
                    (o + (idx[d] if d < len(idx) else 0)) * s
                    for d, (o, s) in enumerate(zip(c.global_offset, gstrides, strict=True))
                )
                src_elem = i * ln
                moves.append(
                    Move(
                        kind="copy" if sdt.name == ddt.name else "cast",
                        file=t.file,
                        dst_offset=dst_base + ddt.nbytes(dst_elem),
                        length=ddt.nbytes(ln),
                        src=c.src,
                        src_offset=c.offset + sdt.nbytes(src_elem),
                        src_dtype=sdt.name,
                        dst_dtype=ddt.name,
                    )
                )
        return moves
    return _gather_moves(t, dst_base, sdt, ddt)


def _ndindex(shape: Sequence[int]) -> Iterable[tuple[int, ...]]:
    if not shape:
        yield ()
        return
    import itertools

    yield from itertools.product(*(range(n) for n in shape))


def _gather_moves(t: TensorPlan, dst_base: int, sdt: dtypes.DType, ddt: dtypes.DType) -> list[Move]:
    """Slabs of `t` along the outermost dim whose rows fit the buffer; one pwrite per slab."""
    g = t.shape
    item = max(sdt.bits, ddt.bits) // 8
    p = 0
    while p < len(g) - 1 and math.prod(g[p + 1 :]) * item > BUFFER_BYTES:
        p += 1
    row = math.prod(g[p + 1 :])
    rows_per_slab = max(1, BUFFER_BYTES // max(1, row * item))
    gstrides = _strides(g)
    live = [c for c in t.chunks if math.prod(c.shape) > 0]
    moves = []
    for prefix in _ndindex(g[:p]):
        owners = [
            c
            for c in live
            if all(c.global_offset[d] <= prefix[d] < c.global_offset[d] + c.shape[d] for d in range(p))
        ]
        for a in range(0, g[p], rows_per_slab):
            b = min(g[p], a + rows_per_slab)
            pieces = []
            for c in owners:
                lo, hi = max(a, c.global_offset[p]), min(b, c.global_offset[p] + c.shape[p])
                if lo >= hi:
                    continue
                ls = _strides(c.shape)
                src_elem = (
                    sum((prefix[d] - c.global_offset[d]) * ls[d] for d in range(p))
                    + (lo - c.global_offset[p]) * ls[p]
                )
                inner = ((c.global_offset[d], c.global_offset[d] + c.shape[d]) for d in range(p + 1, len(g)))
                box = ((lo - a, hi - a), *inner)
                pieces.append(
                    Piece(c.src, c.offset + sdt.nbytes(src_elem), sdt.nbytes((hi - lo) * ls[p]), box)
                )
            dst_elem = sum(prefix[d] * gstrides[d] for d in range(p)) + a * gstrides[p]
            moves.append(
                Move(
                    kind="gather",
                    file=t.file,
                    dst_offset=dst_base + ddt.nbytes(dst_elem),
                    length=ddt.nbytes((b - a) * row),
                    src_dtype=sdt.name,
                    dst_dtype=ddt.name,
                    slab_shape=(b - a, *g[p + 1 :]),
                    pieces=tuple(pieces),
                )
            )
    return moves


def _split_and_merge(moves: list[Move]) -> list[Move]:
    """Coalesce back-to-back copies (tiny tensors), then split big copies so threads share the work."""
    moves.sort(key=lambda m: (m.file, m.dst_offset))
    merged: list[Move] = []
    for m in moves:
        prev = merged[-1] if merged else None
        if (
            prev is not None
            and m.kind == prev.kind == "copy"
            and m.file == prev.file
            and m.src == prev.src
            and prev.dst_offset + prev.length == m.dst_offset
            and prev.src_offset + prev.length == m.src_offset
            and prev.length + m.length <= COPY_PIECE
        ):
            merged[-1] = Move("copy", m.file, prev.dst_offset, prev.length + m.length, m.src, prev.src_offset)
        else:
            merged.append(m)
    out = []
    for m in merged:
        if m.kind == "gather" or m.length <= COPY_PIECE:
            out.append(m)
            continue
        sdt, ddt = dtypes.lookup(m.src_dtype or "U8"), dtypes.lookup(m.dst_dtype or "U8")
        step = COPY_PIECE - COPY_PIECE % 64  # whole elements of any byte-sized dtype
        for off in range(0, m.length, step):
            n = min(step, m.length - off)
            src_off = off if m.kind == "copy" else off * sdt.bits // ddt.bits
            out.append(
                Move(
                    m.kind,
                    m.file,
                    m.dst_offset + off,
                    n,
                    m.src,
                    m.src_offset + src_off,
                    m.src_dtype,
                    m.dst_dtype,
                )
            )
    return out


def plan(
    headers: Sequence[Header],
    *,
    dtype: str | None = None,
    keep_dtype: str | None = None,
    reference: Mapping[str, str] | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    expected: Mapping[str, TensorInfo] | None = None,
    out_dtypes: Mapping[str, str] | None = None,
) -> ExportPlan:
    """Turn validated shard headers into a frozen export plan. Pure: reads nothing, writes nothing.

    `dtype` is a safetensors name (`BF16`) or None to keep; `keep_dtype` a regex of names never cast;
    `reference` a weight_map whose grouping to keep; `expected` the global dtype and shape of every tensor
    as the trainer saw it (from the commit marker), which catches a missing trailing shard; `out_dtypes`
    pins the output dtype of named tensors (verify uses it to re-derive an existing export).
    """
    if dtype is not None:
        dt = dtypes.lookup(dtype)
        if not dt.castable:
            raise DTypeError(f"cannot export as {dtype}: only F32, F16, BF16 and F64 are cast targets")
    keep = _compile(keep_dtype)
    where = str(Path(headers[0].path).parent) if headers else "."
    found: dict[str, list[Chunk]] = {}
    src_dtype: dict[str, str] = {}
    for i, h in enumerate(headers):
        offsets = h.dcp_offsets()
        for name, e in h.tensors.items():
            if src_dtype.setdefault(name, e.dtype) != e.dtype:
                raise PlanError(
                    f"tensor {name!r} is {src_dtype[name]} in one shard and {e.dtype} in {h.path}", path=where
                )
            found.setdefault(name, []).append(Chunk(i, h.data_start + e.begin, offsets[name], e.shape))

    shapes: dict[str, tuple[int, ...]] = {}
    for name, chunks in found.items():
        ndims = {len(c.shape) for c in chunks}
        if len(ndims) != 1:
            raise PlanError(f"tensor {name!r} has chunks of different ranks {sorted(ndims)}", path=where)
        nd = ndims.pop()
        shapes[name] = tuple(max(c.global_offset[d] + c.shape[d] for c in chunks) for d in range(nd))
    if expected is not None:
        _check_expected(shapes, src_dtype, expected, where)
    for name, chunks in found.items():
        _check_tiling(name, shapes[name], chunks, where)

    out_dtype = {n: _out_dtype(n, src_dtype[n], dtype, keep) for n in found}
    for n, dt_name in (out_dtypes or {}).items():
        if n in out_dtype and dt_name != src_dtype[n]:
            if not (dtypes.lookup(src_dtype[n]).castable and dtypes.lookup(dt_name).castable):
                raise DTypeError(f"tensor {n!r}: {src_dtype[n]} cannot become {dt_name}", path=where)
            out_dtype[n] = dt_name
        elif n in out_dtype:
            out_dtype[n] = dt_name
    sizes = {n: dtypes.lookup(out_dtype[n]).nbytes(math.prod(shapes[n])) for n in found}
    groups = (
        assign_with_reference(sizes, reference, max_shard_size)
        if reference is not None
        else pack_by_size(sizes, max_shard_size)
    )
    names = output_file_names(len(groups))
    tensors: list[TensorPlan] = []
    files: list[OutputFile] = []
    moves: list[Move] = []
    for fi, group in enumerate(groups):
        # Widest dtypes first: with an 8-aligned data section every tensor stays aligned for mmap readers.
        order = sorted(group, key=lambda n: (-dtypes.lookup(out_dtype[n]).bits, natural_key(n)))
        entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        pos = 0
        planned = []
        for n in order:
            tp = TensorPlan(
                n, src_dtype[n], out_dtype[n], shapes[n], fi, pos, pos + sizes[n], tuple(found[n])
            )
            entries[n] = (out_dtype[n], shapes[n], pos, pos + sizes[n])
            planned.append(tp)
            pos += sizes[n]
        header = encode_header(entries, {"format": "pt"})
        files.append(OutputFile(names[fi], header, len(header) + pos, tuple(order)))
        for tp in planned:
            moves.extend(_tensor_moves(tp, len(header), headers))
        tensors.extend(planned)
    return ExportPlan(
        sources=tuple(h.path for h in headers),
        files=tuple(files),
        tensors=tuple(tensors),
        moves=tuple(_split_and_merge(moves)),
        total_size=sum(sizes.values()),
    )


def _compile(pattern: str | None) -> re.Pattern[str] | None:
    if not pattern:
        return None
    try:
        return re.compile(pattern)
    except re.error as e:
        raise DTypeError(f"--keep-dtype {pattern!r} is not a valid regular expression: {e}") from None


def _check_expected(
    shapes: Mapping[str, tuple[int, ...]],
    src_dtype: Mapping[str, str],
    expected: Mapping[str, TensorInfo],
    where: str,
) -> None:
    missing = sorted(set(expected) - set(shapes), key=natural_key)
    if missing:
        raise PlanError(
            f"{len(missing)} marker tensors are in no shard (a shard is missing?): {missing[:5]}",
            path=where,
        )
    extra = sorted(set(shapes) - set(expected), key=natural_key)
    if extra:
        raise PlanError(
            f"{len(extra)} tensors in the shards are not in the commit marker: {extra[:5]}", path=where
        )
    for name, info in expected.items():
        if tuple(info.shape) != shapes[name]:
            raise PlanError(
                f"tensor {name!r}: shards cover {list(shapes[name])}, the trainer saved {list(info.shape)}"
                " (a shard is missing?)",
                path=where,
            )
        if info.dtype != src_dtype[name]:
            raise PlanError(
                f"tensor {name!r}: shards hold {src_dtype[name]}, the trainer saved {info.dtype}", path=where
            )


# ---------------------------------------------------------------------------------------------- execution


class _Buffers(threading.local):
    """Per-thread buffers, allocated once and reused: fresh memory is expensive to touch."""

    def get(self) -> tuple[bytearray, bytearray]:
        if not hasattr(self, "a"):
            self.a = bytearray(BUFFER_BYTES)
            self.b = bytearray(BUFFER_BYTES)
        return self.a, self.b


def _pread_into(fd: int, view: memoryview, offset: int, path: str) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise ShardError(f"ends early at byte {offset + done} (truncated while reading?)", path=path)
        done += n


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _cast(src: memoryview, dst: memoryview, src_dtype: str, dst_dtype: str) -> None:
    """dst = src converted with torch's own kernel, which `.to(dtype)` uses too."""
    import torch

    s = torch.frombuffer(src, dtype=dtypes.torch_dtype(src_dtype))
    d = torch.frombuffer(dst, dtype=dtypes.torch_dtype(dst_dtype))
    d.copy_(s)


class _Runner:
    """Carries out moves on open file descriptors. `compare=True` reads the destination and checks it."""

    def __init__(
        self,
        src_fds: Sequence[int],
        src_paths: Sequence[str],
        dst_fds: Sequence[int],
        dst_paths: Sequence[str],
        compare: bool,
    ):
        self.src_fds, self.src_paths = src_fds, src_paths
        self.dst_fds, self.dst_paths = dst_fds, dst_paths
        self.compare = compare
        self.buffers = _Buffers()
        self.copy_file_range = hasattr(os, "copy_file_range") and not compare

    def run(self, m: Move) -> None:
        if m.kind == "copy":
            self._copy(m)
        elif m.kind == "cast":
            self._cast_run(m)
        else:
            self._gather(m)

    def _emit(self, m: Move, data: memoryview, offset: int) -> None:
        fd = self.dst_fds[m.file]
        if not self.compare:
            _pwrite_all(fd, data, offset)
            return
        from stagerd.errors import VerifyError

        got = os.pread(fd, len(data), offset)
        if got != data:
            raise VerifyError(f"bytes at offset {offset} differ from the source", path=self.dst_paths[m.file])

    def _copy(self, m: Move) -> None:
        src_fd, dst_fd = self.src_fds[m.src], self.dst_fds[m.file]
        done = 0
        while self.copy_file_range and done < m.length:
            try:
                n = os.copy_file_range(
                    src_fd, dst_fd, m.length - done, m.src_offset + done, m.dst_offset + done
                )
            except OSError as e:
                if e.errno in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                    self.copy_file_range = False  # this filesystem pair cannot: fall back to pread/pwrite
                    break
                raise
            if n == 0:
                raise ShardError(
                    f"ends early at byte {m.src_offset + done} (truncated while reading?)",
                    path=self.src_paths[m.src],
                )
            done += n
        a, _ = self.buffers.get()
        while done < m.length:
            n = min(len(a), m.length - done)
            view = memoryview(a)[:n]
            _pread_into(src_fd, view, m.src_offset + done, self.src_paths[m.src])
            self._emit(m, view, m.dst_offset + done)
            done += n

    def _cast_run(self, m: Move) -> None:
        sdt, ddt = dtypes.lookup(m.src_dtype), dtypes.lookup(m.dst_dtype)
        a, b = self.buffers.get()
        per = len(a) // max(sdt.bits, ddt.bits) * 8  # elements per round
        total = m.length * 8 // ddt.bits
        done = 0
        while done < total:
            n = min(per, total - done)
            sv = memoryview(a)[: sdt.nbytes(n)]
            dv = memoryview(b)[: ddt.nbytes(n)]
            _pread_into(self.src_fds[m.src], sv, m.src_offset + sdt.nbytes(done), self.src_paths[m.src])
            _cast(sv, dv, sdt.name, ddt.name)
            self._emit(m, dv, m.dst_offset + ddt.nbytes(done))
            done += n

    def _gather(self, m: Move) -> None:
        import numpy as np

        sdt, ddt = dtypes.lookup(m.src_dtype), dtypes.lookup(m.dst_dtype)
        isz = sdt.bits // 8
        a, b = self.buffers.get()
        n = math.prod(m.slab_shape)
        slab = np.frombuffer(a, dtype=np.uint8, count=n * isz).reshape(*m.slab_shape, isz)
        whole, scratch = memoryview(a), memoryview(b)
        for pc in m.pieces:
            path = self.src_paths[pc.src]
            offsets, seg = _segments(pc.box, m.slab_shape, isz)
            if seg >= SCATTER_MIN_SEGMENT:
                # Read straight into the slab rows: one preadv per IOV_MAX segments, no extra copy.
                _preadv_scatter(
                    self.src_fds[pc.src], [whole[o : o + seg] for o in offsets], pc.src_offset, path
                )
                continue
            view = scratch[: pc.length]
            _pread_into(self.src_fds[pc.src], view, pc.src_offset, path)
            shape = tuple(hi - lo for lo, hi in pc.box)
            src = np.frombuffer(view, dtype=np.uint8).reshape(*shape, isz)
            slab[tuple(slice(lo, hi) for lo, hi in pc.box)] = src
        out = whole[: n * isz]
        if sdt.name != ddt.name:
            dv = scratch[: ddt.nbytes(n)]
            _cast(out, dv, sdt.name, ddt.name)
            out = dv
        self._emit(m, out, m.dst_offset)


def _segments(box: Sequence[tuple[int, int]], slab_shape: Sequence[int], isz: int) -> tuple[list[int], int]:
    """Byte offsets in the slab of a piece's contiguous destination segments, and their common length."""
    import numpy as np

    k = len(slab_shape) - 1
    while k > 0 and tuple(box[k]) == (0, slab_shape[k]):
        k -= 1
    strides = _strides(slab_shape)
    offsets = np.array([box[k][0] * strides[k]], dtype=np.int64)
    for d in range(k - 1, -1, -1):
        offsets = (
            np.arange(box[d][0], box[d][1], dtype=np.int64)[:, None] * strides[d] + offsets[None, :]
        ).ravel()
    return (offsets * isz).tolist(), (box[k][1] - box[k][0]) * strides[k] * isz


def _preadv_scatter(fd: int, views: Sequence[memoryview], offset: int, path: str) -> None:
    for i in range(0, len(views), IOV_MAX):
        batch = views[i : i + IOV_MAX]
        want = sum(len(v) for v in batch)
        got = os.preadv(fd, batch, offset)
        if got < want:  # short read: finish view by view, so truncation is still caught
            pos = 0
            for v in batch:
                if pos + len(v) > got:
                    skip = max(0, got - pos)
                    _pread_into(fd, v[skip:], offset + pos + skip, path)
                pos += len(v)
        offset += want


def _run_moves(
    runner: _Runner,
    moves: Sequence[Move],
    threads: int,
    progress: ProgressFn | None,
    total: int,
    on_done: Callable[[Move], None] | None = None,
) -> None:
    lock = threading.Lock()
    state = {"next": 0, "done": 0, "error": None}

    def worker() -> None:
        while True:
            with lock:
                if state["error"] is not None or state["next"] >= len(moves):
                    return
                m = moves[state["next"]]
                state["next"] += 1
            try:
                runner.run(m)
                if on_done is not None:
                    on_done(m)
            except BaseException as e:
                with lock:
                    if state["error"] is None:
                        state["error"] = e
                return
            with lock:
                state["done"] += m.length
                done = state["done"]
            if progress is not None:
                progress(done, total)

    n = max(1, min(threads, len(moves)))
    if n == 1:
        worker()
    else:
        with ThreadPoolExecutor(n, thread_name_prefix="stagerd-export") as pool:
            for f in [pool.submit(worker) for _ in range(n)]:
                f.result()
    if state["error"] is not None:
        raise state["error"]


_SYNC_FILE_RANGE_WRITE = 2


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    import ctypes
    import ctypes.util

    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


class _Flusher:
    """Durability without a stall at the end: each finished move's range starts writeback at once
    (`sync_file_range`, asynchronous), and each file is fsynced on its own thread as soon as its last move
    lands, so the disk writes while the CPU is still copying the next file."""

    def __init__(self, fds: Sequence[int], moves: Sequence[Move]) -> None:
        from collections import Counter

        self.fds = fds
        self.left = Counter(m.file for m in moves)
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="stagerd-fsync")
        self.futures: dict[int, Future[None]] = {}
        self.writeback = _sync_file_range()

    def done(self, m: Move) -> None:
        fd = self.fds[m.file]
        if self.writeback is not None:
            self.writeback(
                fd, m.dst_offset, m.length, _SYNC_FILE_RANGE_WRITE
            )  # a hint: errors surface in fsync
        with self.lock:
            self.left[m.file] -= 1
            if self.left[m.file] == 0:
                self.futures[m.file] = self.pool.submit(os.fsync, fd)

    def finish(self) -> None:
        """fsync the files no move touched, then wait for every fsync; its error is the write's error."""
        for i, fd in enumerate(self.fds):
            if i not in self.futures:
                self.futures[i] = self.pool.submit(os.fsync, fd)
        for f in self.futures.values():
            f.result()


def _open_sources(p: ExportPlan) -> list[int]:
    fds = []
    try:
        for path in p.sources:
            fds.append(os.open(path, os.O_RDONLY | os.O_CLOEXEC))
    except OSError as e:
        for fd in fds:
            os.close(fd)
        raise ShardError(f"cannot open: {e.strerror}", path=e.filename) from None
    return fds


def _output_error(e: OSError, path: object) -> OutputError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return OutputError(
            "no space left on the output filesystem",
            path=path,
            hint="free space on the output filesystem, then retry",
        )
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return OutputError(f"not writable: {e.strerror}", path=path)
    return OutputError(f"write failed: {e.strerror or e}", path=path)


def execute(
    p: ExportPlan, out_dir: Path, *, threads: int = 2, progress: ProgressFn | None = None, fsync: bool = True
) -> None:
    """Write the plan's files into `out_dir` (an empty directory the caller renames into place)."""
    src_fds = _open_sources(p)
    dst_fds: list[int] = []
    dst_paths = [str(out_dir / f.name) for f in p.files]
    try:
        for f, path in zip(p.files, dst_paths, strict=True):
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
                dst_fds.append(fd)
                _reserve(fd, f.size)
                _pwrite_all(fd, memoryview(f.header), 0)
            except OSError as e:
                raise _output_error(e, path) from None
        runner = _Runner(src_fds, list(p.sources), dst_fds, dst_paths, compare=False)
        flusher = _Flusher(dst_fds, p.moves) if fsync else None
        try:
            try:
                _run_moves(runner, p.moves, threads, progress, p.bytes_to_write, flusher and flusher.done)
                if flusher is not None:
                    flusher.finish()
            finally:
                if flusher is not None:
                    flusher.pool.shutdown()
        except OSError as e:
            raise _output_error(e, out_dir) from None
    finally:
        for fd in src_fds + dst_fds:
            os.close(fd)


def compare(p: ExportPlan, export_dir: Path, *, threads: int = 2, progress: ProgressFn | None = None) -> None:
    """Re-derive every output byte from the sources and check the export holds exactly that."""
    from stagerd.errors import VerifyError

    src_fds = _open_sources(p)
    dst_fds: list[int] = []
    dst_paths = [str(export_dir / f.name) for f in p.files]
    try:
        for f, path in zip(p.files, dst_paths, strict=True):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                raise VerifyError("missing from the export", path=path) from None
            dst_fds.append(fd)
            if os.fstat(fd).st_size != f.size:
                raise VerifyError(f"is {os.fstat(fd).st_size} bytes, the source gives {f.size}", path=path)
            if os.pread(fd, len(f.header), 0) != f.header:
                raise VerifyError("header differs from the one the source gives", path=path)
        _run_moves(
            _Runner(src_fds, list(p.sources), dst_fds, dst_paths, compare=True),
            p.moves,
            threads,
            progress,
            p.bytes_to_write,
        )
    finally:
        for fd in src_fds + dst_fds:
            os.close(fd)


def _reserve(fd: int, size: int) -> None:
    """Reserve the blocks up front so a full disk fails before any copying, not halfway."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, size)


# ---------------------------------------------------------------------------------------------- top level


@dataclass(frozen=True)
class ConsolidateResult:
    files: tuple[tuple[str, int], ...]
    tensors: int
    total_size: int


def consolidate_into(
    src: Path,
    out_dir: Path,
    *,
    listed: Iterable[str] | None = None,
    dtype: str | None = None,
    keep_dtype: str | None = None,
    reference: Mapping[str, str] | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    expected: Mapping[str, TensorInfo] | None = None,
    threads: int = 2,
    progress: ProgressFn | None = None,
) -> ConsolidateResult:
    """Plan from the shards in `src` and write the safetensors files plus the index into `out_dir`."""
    from stagerd.contract.layout import write_json_atomic

    headers = scan_shards(src, listed)
    p = plan(
        headers,
        dtype=dtype,
        keep_dtype=keep_dtype,
        reference=reference,
        max_shard_size=max_shard_size,
        expected=expected,
    )
    execute(p, out_dir, threads=threads, progress=progress)
    try:
        write_json_atomic(out_dir / INDEX_NAME, p.index())
    except OSError as e:
        raise _output_error(e, out_dir / INDEX_NAME) from None
    return ConsolidateResult(tuple((f.name, f.size) for f in p.files), len(p.tensors), p.total_size)


__all__ = [
    "ConsolidateResult",
    "ExportPlan",
    "Move",
    "compare",
    "consolidate_into",
    "execute",
    "plan",
    "scan_shards",
]
