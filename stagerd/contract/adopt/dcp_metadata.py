"""DCP's `.metadata` (FileSystemWriter), read without torch and without running its pickle.

The file is a pickle of `torch.distributed.checkpoint.metadata.Metadata`: dataclasses holding `torch.dtype`,
`torch.Size`, a layout and a memory-format enum, and `_StorageInfo` records naming where each chunk's bytes
are. An unpickler that resolves only those names, each to a plain record defined here (never to torch's
class), reads it; any other global is a `DcpFormatError` naming it. The records are then checked and turned
into `DcpMetadata`: every tensor's global dtype and shape, its chunks, and each chunk's file, offset and
length. Non-tensor entries (`BytesStorageMetadata`: step counters, RNG state, a scheduler) are only named:
their bytes are pickles too and are never read.
"""

from __future__ import annotations

import io
import math
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stagerd.contract import dtypes
from stagerd.contract.pickle_depth import PickleShapeError, check_depth, show
from stagerd.contract.regular_file import open_regular, read_bounded
from stagerd.errors import DcpFormatError

METADATA_NAME = ".metadata"
MAX_METADATA_BYTES = 256 << 20
MAX_PATH_CHARS = 4096  # a pickled path (StorageMeta's checkpoint_id), joined from its parts
_DCP = "torch.distributed.checkpoint.metadata"


class _Record:
    """A pickled dataclass, as attributes: BUILD fills `__dict__` from the pickled state."""

    kind = "record"

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):  # (dict, slots)
            state = {**(state[0] or {}), **state[1]}
        if not isinstance(state, dict):
            raise DcpFormatError(f"a {self.kind} record holds a {type(state).__name__}, not its fields")
        self.__dict__.update(state)

    def get(self, name: str) -> Any:
        return self.__dict__.get(name)


def _record(kind: str) -> type[_Record]:
    return type(kind, (_Record,), {"kind": kind})


_PROPERTIES = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")


class _TensorProperties(_Record):
    kind = "TensorProperties"

    def __setstate__(self, state: Any) -> None:
        # torch pickles (dtype, layout, requires_grad, memory_format, pin_memory) through __getstate__.
        if isinstance(state, tuple) and len(state) == 5:
            state = dict(zip(_PROPERTIES, state, strict=True))
        super().__setstate__(state)


@dataclass(frozen=True, eq=False)  # hashed by identity: BUILD can give it any `name`
class _TorchDType:
    name: str  # the attribute of the torch module: "float32"


def _size(dims: Any = ()) -> tuple[int, ...]:
    if not isinstance(dims, tuple | list) or not all(_is_uint(d) for d in dims):
        raise DcpFormatError(f"a torch.Size of {show(dims)} is not a tuple of non-negative integers")
    return tuple(dims)


def _layout(name: Any) -> str:
    if not isinstance(name, str):
        raise DcpFormatError(f"a layout named {show(name)}")
    return name


def _mem_format(code: Any) -> int:
    if not _is_uint(code):
        raise DcpFormatError(f"a memory format {show(code)}")
    return int(code)


def _path(*parts: Any) -> str:
    # str() of an arbitrary value could be exponential (a list holding itself twice, n times over), and one
    # memoized string repeated costs two bytes a copy: only strings, and only a path's length.
    if not all(isinstance(p, str) for p in parts) or sum(map(len, parts)) > MAX_PATH_CHARS:
        raise DcpFormatError(f"a path of {len(parts)} parts that are not strings of a path's length")
    return "/".join(parts)


_GLOBALS: dict[tuple[str, str], Callable[..., Any] | type] = {
    (_DCP, "Metadata"): _record("Metadata"),
    (_DCP, "MetadataIndex"): _record("MetadataIndex"),
    (_DCP, "StorageMeta"): _record("StorageMeta"),
    (_DCP, "TensorStorageMetadata"): _record("TensorStorageMetadata"),
    (_DCP, "BytesStorageMetadata"): _record("BytesStorageMetadata"),
    (_DCP, "ChunkStorageMetadata"): _record("ChunkStorageMetadata"),
    (_DCP, "TensorProperties"): _TensorProperties,
    (_DCP, "_MEM_FORMAT_ENCODING"): _mem_format,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _record("_StorageInfo"),
    ("torch.serialization", "_get_layout"): _layout,
    ("torch", "Size"): _size,
    ("pathlib", "PosixPath"): _path,
    ("pathlib", "PurePosixPath"): _path,
    ("pathlib", "Path"): _path,
    ("collections", "OrderedDict"): dict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "tuple"): tuple,
    ("builtins", "list"): list,
    ("builtins", "dict"): dict,
}
_TORCH_DTYPES = {d.torch_name: d.name for d in dtypes.DTYPES.values() if d.torch_name}
_TORCH_DTYPES.update({"float": "F32", "double": "F64", "half": "F16", "long": "I64", "int": "I32"})
_TORCH_DTYPES.update({"short": "I16"})


class _AllowlistUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, where: object) -> None:
        super().__init__(io.BytesIO(data))
        self._where = where

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in _TORCH_DTYPES:
            return _TorchDType(name)
        found = _GLOBALS.get((module, name))
        if found is None:
            raise DcpFormatError(
                f"refusing to unpickle {module}.{name}: DCP metadata holds only checkpoint records",
                path=self._where,
                hint="this .metadata was not written by torch.distributed.checkpoint; it is never loaded",
            )
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise DcpFormatError("DCP metadata holds a persistent reference", path=self._where)


@dataclass(frozen=True, slots=True)
class DcpChunk:
    """One saved block of a tensor: where it sits in the tensor, and where its record is."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str  # relative to the DCP directory: `__0_0.distcp`
    offset: int  # of the chunk's record in that file
    length: int


@dataclass(frozen=True, slots=True)
class DcpTensor:
    dtype: str  # safetensors name
    shape: tuple[int, ...]
    chunks: tuple[DcpChunk, ...]


@dataclass(frozen=True)
class DcpMetadata:
    """What a FileSystemWriter checkpoint holds: tensors (global dtype, shape, chunks) and other keys."""

    tensors: dict[str, DcpTensor]
    other: tuple[str, ...]  # keys saved as pickled objects (never read)
    files: tuple[str, ...]  # every data file a tensor chunk lives in, sorted


def read_dcp_metadata(path: str | Path) -> DcpMetadata:
    """Read and check `path` (a DCP `.metadata`); any defect is a DcpFormatError naming the file."""
    return parse_dcp_metadata(read_metadata_bytes(path), path)


def read_metadata_bytes(path: str | Path) -> bytes:
    """The bytes of a `.metadata`, bounded; absent is a DcpFormatError (the checkpoint is not finished)."""
    path = Path(path)
    try:
        with open_regular(path) as f:  # a FIFO named .metadata must not hold the scan
            data = read_bounded(f, MAX_METADATA_BYTES + 1)
    except FileNotFoundError:
        raise DcpFormatError("no .metadata: the checkpoint is not finished", path=path) from None
    except OSError as e:
        raise DcpFormatError(f"cannot read: {e.strerror}", path=path) from None
    if len(data) > MAX_METADATA_BYTES:
        raise DcpFormatError(f"larger than {MAX_METADATA_BYTES >> 20} MiB", path=path)
    return data


def parse_dcp_metadata(data: bytes, where: object) -> DcpMetadata:
    try:
        check_depth(data)
        meta = _AllowlistUnpickler(data, where).load()
    except PickleShapeError as e:
        raise DcpFormatError(f"unreadable DCP metadata: {e}", path=where) from None
    except DcpFormatError as e:
        raise DcpFormatError(e.message, path=where, hint=e.hint) from None
    except Exception as e:  # truncated or garbled: a named error, not a traceback from pickle
        raise DcpFormatError(f"unreadable DCP metadata: {type(e).__name__}: {e}", path=where) from None
    if not isinstance(meta, _Record) or meta.kind != "Metadata":
        raise DcpFormatError(f"holds a {type(meta).__name__}, not DCP's Metadata", path=where)
    try:
        return _checked(meta, where)
    except DcpFormatError as e:  # `_size`'s, raised where the file is not known
        if e.path is not None:
            raise
        raise DcpFormatError(e.message, path=where, hint=e.hint) from None
    except (AttributeError, TypeError, ValueError, KeyError) as e:
        raise DcpFormatError(f"malformed DCP metadata: {e!r}", path=where) from None


def _checked(meta: _Record, where: object) -> DcpMetadata:
    sd, storage = meta.get("state_dict_metadata"), meta.get("storage_data")
    if not isinstance(sd, dict) or not isinstance(storage, dict):
        raise DcpFormatError("DCP metadata without state_dict_metadata and storage_data", path=where)
    places: dict[tuple[str, tuple[int, ...]], tuple[str, int, int]] = {}
    for index, info in storage.items():
        if not (isinstance(index, _Record) and index.kind == "MetadataIndex"):
            raise DcpFormatError(f"a storage key is a {type(index).__name__}", path=where)
        fqn = index.get("fqn")
        if not isinstance(fqn, str):
            raise DcpFormatError(f"a storage key names {type(fqn).__name__} {show(fqn)}", path=where)
        _check_utf8(fqn, where)
        if not (isinstance(info, _Record) and info.kind == "_StorageInfo"):
            raise DcpFormatError(f"storage of {fqn!r} is a {type(info).__name__}", path=where)
        offset = index.get("offset")
        if offset is None:
            continue  # a pickled object's record
        file, at, length = info.get("relative_path"), info.get("offset"), info.get("length")
        # a NUL too: no file can be named with one (os.open raises ValueError)
        if not (
            isinstance(file, str)
            and file
            and "/" not in file
            and "\0" not in file
            and file not in (".", "..")
        ):
            raise DcpFormatError(f"tensor {fqn!r}: its file {show(file)} is not a plain name", path=where)
        if not (_is_uint(at) and _is_uint(length)):
            raise DcpFormatError(f"tensor {fqn!r}: offset {show(at)} and length {show(length)}", path=where)
        if info.get("transform_descriptors"):
            raise DcpFormatError(
                f"tensor {fqn!r} is stored through {show(info.get('transform_descriptors'))} "
                "(a compression or other stream transform): its bytes cannot be read at an offset",
                path=where,
            )
        places[(fqn, _size(offset))] = (file, at, length)
    tensors: dict[str, DcpTensor] = {}
    other: list[str] = []
    for fqn, md in sd.items():
        if not isinstance(fqn, str) or not isinstance(md, _Record):
            raise DcpFormatError(f"entry {show(fqn)} is a {type(md).__name__}", path=where)
        _check_utf8(fqn, where)
        if md.kind == "BytesStorageMetadata":
            other.append(fqn)
            continue
        if md.kind != "TensorStorageMetadata":
            raise DcpFormatError(f"entry {fqn!r} is a {md.kind}", path=where)
        tensors[fqn] = _tensor(fqn, md, places, where)
    files = sorted({c.file for t in tensors.values() for c in t.chunks})
    return DcpMetadata(tensors, tuple(other), tuple(files))


def _tensor(
    fqn: str, md: _Record, places: dict[tuple[str, tuple[int, ...]], tuple[str, int, int]], where: object
) -> DcpTensor:
    props = md.get("properties")
    dt = props.get("dtype") if isinstance(props, _Record) else None
    if not isinstance(dt, _TorchDType):
        raise DcpFormatError(f"tensor {fqn!r} has no dtype", path=where)
    layout = props.get("layout")
    if layout not in (None, "torch.strided"):
        raise DcpFormatError(
            f"tensor {fqn!r} has layout {show(layout)}; only strided tensors export", path=where
        )
    shape = _size(md.get("size"))
    chunks = []
    # A memo reference costs the pickle two bytes: without this, one record repeated would be a new chunk
    # each time, memory out of all proportion to the file's bytes.
    seen: set[tuple[int, ...]] = set()
    for c in md.get("chunks") or ():
        if not isinstance(c, _Record) or c.kind != "ChunkStorageMetadata":
            raise DcpFormatError(f"tensor {fqn!r}: a chunk is a {type(c).__name__}", path=where)
        offs, sizes = _size(c.get("offsets")), _size(c.get("sizes"))
        if len(offs) != len(shape) or len(sizes) != len(shape):
            raise DcpFormatError(f"tensor {fqn!r}{list(shape)}: chunk at {list(offs)} of rank", path=where)
        if any(o + s > d for o, s, d in zip(offs, sizes, shape, strict=True)):
            raise DcpFormatError(
                f"tensor {fqn!r}{list(shape)}: chunk {list(sizes)} at {list(offs)} is out of bounds",
                path=where,
            )
        place = places.get((fqn, offs))
        if place is None:
            if math.prod(sizes) == 0:
                continue  # an empty chunk has no bytes, and DCP may record none
            raise DcpFormatError(
                f"tensor {fqn!r}: no storage recorded for its chunk at {list(offs)}", path=where
            )
        if offs in seen:
            raise DcpFormatError(f"tensor {fqn!r}: chunk at {list(offs)} recorded twice", path=where)
        seen.add(offs)
        chunks.append(DcpChunk(offs, sizes, *place))
    name = _TORCH_DTYPES[dt.name]
    return DcpTensor(name, shape, tuple(chunks))


def _check_utf8(fqn: str, where: object) -> None:
    """pickle decodes names with surrogatepass: a lone surrogate would reach the export, where no name of
    a safetensors file can hold it (and `encode()` there is a bare UnicodeEncodeError)."""
    if fqn.isascii():
        return
    try:
        fqn.encode("utf-8")
    except UnicodeEncodeError:
        raise DcpFormatError(f"entry {fqn!r} is not valid UTF-8", path=where) from None


def _is_uint(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0
