"""The frozen export plan: what `plan()` decides and `execute()` / `compare()` carry out.

The plan holds numbers, names and byte offsets only, so it can be checked, printed or compared before a
single byte moves. Its per-tensor data lives in flat read-only arrays (a few dozen bytes per tensor);
`Chunk`, `TensorPlan`, `Piece` and `Move` are built from them one tensor at a time while the plan runs
(`moves.plan_moves`), never all at once.
"""

from __future__ import annotations

import enum
import functools
import math
from array import array
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from stagerd.contract import dtypes

# dtype code (the index here) <-> safetensors name; a code fits one byte.
DTYPE_NAMES: tuple[str, ...] = tuple(dtypes.DTYPES)
DTYPE_CODE: dict[str, int] = {name: i for i, name in enumerate(DTYPE_NAMES)}


class MoveKind(enum.Enum):
    """How a move's bytes travel.

    - `COPY`: a contiguous source run to a contiguous destination run, same dtype (`copy_file_range`).
    - `CAST`: the same, through bounded buffers and the numpy cast kernel.
    - `GATHER`: a slab of a tensor whose chunks are strided in the output (e.g. `Shard(1)`): each chunk's
      rows are read with `pread` into one bounded buffer, placed with numpy, cast if asked, then one `pwrite`.
    """

    COPY = "copy"
    CAST = "cast"
    GATHER = "gather"


@dataclass(frozen=True, slots=True)
class Chunk:
    """One block of a tensor in one source shard: row-major at `offset`, or, with `strides`, element
    (i, j, ...) at `offset + (i * strides[0] + j * strides[1] + ...) * itemsize` (a transposed view)."""

    src: int
    offset: int  # absolute byte offset of the block in the source file
    global_offset: tuple[int, ...]
    shape: tuple[int, ...]
    strides: tuple[int, ...] = ()  # source strides in elements, per dim; () for row-major


@dataclass(frozen=True, slots=True)
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


@dataclass(frozen=True, slots=True)
class Piece:
    """Part of a gather: `length` contiguous source bytes, placed at `box` ([start, stop) per dim) in
    row-major order; with `strides` (source bytes per box dim), the box's elements lie at those strides
    from `src_offset` instead, inside the `length` bytes from there (a strided block, read tile-wise).
    In a pack's one-row slab (`engine/pack.py`), `rows` (count, step) says the `length` bytes are `count`
    equal runs, the first at `box` and each next `step` elements further (a block split inside its rows)."""

    src: int
    src_offset: int
    length: int
    box: tuple[tuple[int, int], ...]
    strides: tuple[int, ...] = ()
    rows: tuple[int, int] = (1, 0)


@dataclass(frozen=True, slots=True)
class Move:
    """One unit of work. `dst_offset` is absolute in the output file; `length` counts destination bytes."""

    kind: MoveKind
    file: int
    dst_offset: int
    length: int
    src: int = -1
    src_offset: int = 0
    src_dtype: str = ""
    dst_dtype: str = ""
    slab_shape: tuple[int, ...] = ()
    pieces: tuple[Piece, ...] = ()


def frozen(a: array) -> memoryview:
    """A read-only view of a flat array: the plan cannot be changed once made, and indexing gives ints."""
    return memoryview(a).toreadonly()


@dataclass(frozen=True)
class Names:
    """Tensor names as one UTF-8 blob: name `t` is `blob[end[t - 1] : end[t]]`. A str object per name
    would cost about twice the bytes, and each would pin the allocator arena it was decoded into
    beside one shard's freed header."""

    blob: bytes
    end: memoryview

    def __len__(self) -> int:
        return len(self.end)

    def __getitem__(self, t: int) -> str:
        return self.blob[self.end[t - 1] if t else 0 : self.end[t]].decode()

    def __iter__(self) -> Iterator[str]:
        return (self[t] for t in range(len(self)))


@dataclass(frozen=True)
class ChunkTable:
    """Blocks by tensor. Tensor `t` (an id into `names`) owns blocks `order[first[t]:first[t + 1]]`; block
    `c` lies at byte `offset[c]` of source `src[c]`, its global offset at `dims[at[c] : at[c] + ndim[c]]`
    and its shape right after."""

    sources: tuple[str, ...]
    names: Names
    dtype: memoryview  # per tensor: dtype code
    src: memoryview
    offset: memoryview
    at: memoryview
    ndim: memoryview
    dims: memoryview
    order: memoryview
    first: memoryview
    strided: Mapping[int, tuple[int, ...]] = field(default_factory=dict)  # block -> its `Chunk.strides`

    @functools.cached_property
    def where(self) -> str:
        """The shard directory, for errors about the checkpoint as a whole (kept: moves use it per tensor)."""
        return str(Path(self.sources[0]).parent) if self.sources else "."

    def dtype_name(self, t: int) -> str:
        return DTYPE_NAMES[self.dtype[t]]

    def chunks_of(self, t: int) -> list[Chunk]:
        out = []
        for i in range(self.first[t], self.first[t + 1]):
            c = self.order[i]
            at, nd = self.at[c], self.ndim[c]
            out.append(
                Chunk(
                    self.src[c],
                    self.offset[c],
                    tuple(self.dims[at : at + nd]),
                    tuple(self.dims[at + nd : at + 2 * nd]),
                    self.strided.get(c, ()),
                )
            )
        return out


@dataclass(frozen=True, slots=True)
class OutputFile:
    """One output file: its tensors are the plan's rows `first` to `stop` (exclusive), in file order."""

    name: str
    header_size: int
    size: int
    first: int
    stop: int

    @property
    def data_size(self) -> int:
        return self.size - self.header_size


@dataclass(frozen=True)
class ExportPlan:
    """Everything `execute` needs, decided up front.

    Row `r` (file order) is tensor `tensor[r]` of `chunks`, written as dtype code `dst_dtype[r]` at
    `[begin[r], end[r])` of its file's data section; tensor `t`'s global shape is
    `dims[shape_at[t] : shape_at[t] + chunks.ndim of any of its blocks]`.
    """

    chunks: ChunkTable
    files: tuple[OutputFile, ...]
    tensor: memoryview
    dst_dtype: memoryview
    begin: memoryview
    end: memoryview
    shape_at: memoryview
    shape_ndim: memoryview
    dims: memoryview
    total_size: int
    parameters: int | None = None  # the saver's own num_parameters(), where the to-Hub plan records it
    named_dtype: str | None = None  # the dtype config.json names where it is not the cast's (`plan()`)

    @property
    def sources(self) -> tuple[str, ...]:
        return self.chunks.sources

    @property
    def tensor_count(self) -> int:
        return len(self.tensor)

    @property
    def bytes_to_write(self) -> int:
        """The moves tile every tensor exactly once, so they write the data sections and nothing else (not
        `total_size`, which counts a shared storage's bytes, as save_pretrained's index does)."""
        return sum(f.data_size for f in self.files)

    def shape(self, t: int) -> tuple[int, ...]:
        at = self.shape_at[t]
        return tuple(self.dims[at : at + self.shape_ndim[t]])

    def row(self, r: int, file: int) -> TensorPlan:
        """Row `r` (in file `file`) with its chunks, built on demand."""
        t = self.tensor[r]
        return TensorPlan(
            self.chunks.names[t],
            self.chunks.dtype_name(t),
            DTYPE_NAMES[self.dst_dtype[r]],
            self.shape(t),
            file,
            self.begin[r],
            self.end[r],
            tuple(self.chunks.chunks_of(t)),
        )

    def entries(self, file: int) -> Iterator[tuple[str, str, tuple[int, ...], int, int]]:
        """(name, dtype, shape, begin, end) of each tensor of `file`, in header order."""
        f = self.files[file]
        for r in range(f.first, f.stop):
            t = self.tensor[r]
            yield (
                self.chunks.names[t],
                DTYPE_NAMES[self.dst_dtype[r]],
                self.shape(t),
                self.begin[r],
                self.end[r],
            )

    def weight_map(self) -> dict[str, str]:
        """Tensor name -> output file name, in code point order (save_pretrained's `sort_keys`)."""
        pairs = [
            (self.chunks.names[self.tensor[r]], f.name) for f in self.files for r in range(f.first, f.stop)
        ]
        pairs.sort()
        return dict(pairs)

    @property
    def has_index(self) -> bool:
        """Whether the export writes `model.safetensors.index.json`: not for one file (save_pretrained
        writes none), but for no tensors at all, where the index is what marks the export whole."""
        return len(self.files) != 1

    @property
    def total_parameters(self) -> int:
        """The index's `total_parameters`: the saver's num_parameters() where the plan records it (it
        leaves out buffers), else the elements over every output tensor."""
        if self.parameters is not None:
            return self.parameters
        return sum(math.prod(self.shape(self.tensor[r])) for r in range(len(self.tensor)))

    def dtype_bytes(self) -> tuple[tuple[str, int], ...]:
        """(safetensors dtype name, bytes written in it), per output dtype present."""
        out: dict[str, int] = {}
        for r in range(len(self.tensor)):
            name = DTYPE_NAMES[self.dst_dtype[r]]
            out[name] = out.get(name, 0) + self.end[r] - self.begin[r]
        return tuple(sorted(out.items()))

    def index(self) -> dict[str, object]:
        """`model.safetensors.index.json`, derived from the same plan as the headers."""
        metadata = {"total_parameters": self.total_parameters, "total_size": self.total_size}
        return {"metadata": metadata, "weight_map": self.weight_map()}
