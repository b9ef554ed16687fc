"""The frozen export plan: what `plan()` decides and `execute()` / `compare()` carry out.

Every type here is immutable and holds only numbers, names and byte offsets, so a plan can be checked,
printed or compared before a single byte moves. `__slots__` keeps a 100k-tensor plan small.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from stagerd.contract.sharding import natural_key


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
    """One block of a tensor in one source shard."""

    src: int
    offset: int  # absolute byte offset of the block in the source file
    global_offset: tuple[int, ...]
    shape: tuple[int, ...]


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
    """Part of a gather: `length` contiguous source bytes, placed at `box` ([start, stop) per dim)."""

    src: int
    src_offset: int
    length: int
    box: tuple[tuple[int, int], ...]


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


@dataclass(frozen=True, slots=True)
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

    def weight_map(self) -> dict[str, str]:
        """Tensor name -> output file name, in natural key order."""
        return {
            t.name: self.files[t.file].name for t in sorted(self.tensors, key=lambda t: natural_key(t.name))
        }

    def index(self) -> dict[str, object]:
        """`model.safetensors.index.json`, derived from the same plan as the headers."""
        return {"metadata": {"total_size": self.total_size}, "weight_map": self.weight_map()}

    @property
    def bytes_to_write(self) -> int:
        return sum(m.length for m in self.moves)
