"""Where a tensor's bytes are inside one record of a FileSystemWriter file, without torch.

FileSystemWriter (`SerializationFormat.TORCH_SAVE`, its default and the only format its own reader loads;
checked on torch 2.13) writes each tensor chunk as a whole `torch.save` archive at the offset `.metadata`
records: an uncompressed zip whose `data.pkl` rebuilds the tensor from the storage in `data/0`. So the
bytes are there as they are in memory, and only their place needs finding: the zip's directory (stdlib
`zipfile`, on a window of the file that ends where the record ends) gives the member, its local header
gives the first byte, and `data.pkl` (read by an unpickler that knows only `_rebuild_tensor_v2` and
`_rebuild_tensor_v3`, the storage classes, torch's dtypes and `OrderedDict`, each resolved to a record
here) gives dtype, shape, strides and the offset into the storage. torch pickles a dtype that has no typed
storage class (fp8, uint16/32/64) with `_rebuild_tensor_v3`: an `UntypedStorage` counted in bytes and the
dtype given apart. Only a contiguous tensor whose storage is one stored member is read by offset;
anything else is a `DcpFormatError` naming what was found.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import struct
import zipfile
from dataclasses import dataclass
from typing import Any

from stagerd.contract import dtypes
from stagerd.contract.pickle_depth import check_depth, show
from stagerd.errors import DcpFormatError

MAX_PICKLE_BYTES = 1 << 20
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., name length, extra length (30 bytes)
_STORAGE_DTYPES = {
    "DoubleStorage": "F64",
    "FloatStorage": "F32",
    "HalfStorage": "F16",
    "BFloat16Storage": "BF16",
    "LongStorage": "I64",
    "IntStorage": "I32",
    "ShortStorage": "I16",
    "CharStorage": "I8",
    "ByteStorage": "U8",
    "BoolStorage": "BOOL",
    "UInt16Storage": "U16",
    "UInt32Storage": "U32",
    "UInt64Storage": "U64",
    "ComplexFloatStorage": "C64",
    "Float8_e4m3fnStorage": "F8_E4M3",
    "Float8_e5m2Storage": "F8_E5M2",
    "Float8_e4m3fnuzStorage": "F8_E4M3FNUZ",
    "Float8_e5m2fnuzStorage": "F8_E5M2FNUZ",
    "Float8_e8m0fnuStorage": "F8_E8M0",
}


@dataclass(frozen=True, slots=True)
class RecordedTensor:
    """A tensor record's bytes: `nbytes` from absolute file offset `begin`, of `dtype` and `shape`."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    nbytes: int


class _Window(io.RawIOBase):
    """[base, base + length) of an open file, as a seekable stream that cannot read past it."""

    def __init__(self, fd: int, base: int, length: int) -> None:
        self._fd, self._base, self._len, self._pos = fd, base, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = max(0, {0: pos, 1: self._pos + pos, 2: self._len + pos}[whence])
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self._len - self._pos))
        data = os.pread(self._fd, n, self._base + self._pos) if n else b""
        b[: len(data)] = data
        self._pos += len(data)
        return len(data)


@dataclass(frozen=True, eq=False)  # hashed by identity: BUILD can change its fields
class _StorageType:
    dtype: str


_UNTYPED = "UNTYPED"  # torch.storage.UntypedStorage: its numel counts bytes; the tensor names the dtype
_TORCH_DTYPES = {d.torch_name: d.name for d in dtypes.DTYPES.values() if d.torch_name is not None}


@dataclass(frozen=True, eq=False)
class _DType:
    dtype: str


@dataclass(frozen=True, eq=False)
class _Storage:
    dtype: str
    key: str
    numel: int


@dataclass(frozen=True, eq=False)
class _Rebuilt:
    storage: _Storage
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild_tensor_v2(storage: Any, offset: Any, size: Any, stride: Any, *_rest: Any) -> _Rebuilt:
    if not isinstance(storage, _Storage) or storage.dtype == _UNTYPED or not _uint(offset):
        raise DcpFormatError("a tensor record that is not a tensor of one storage")
    if not all(isinstance(t, tuple) and all(_uint(d) for d in t) for t in (size, stride)):
        raise DcpFormatError("a tensor record with a malformed size or stride")
    return _Rebuilt(storage, offset, size, stride)


def _rebuild_tensor_v3(
    storage: Any, offset: Any, size: Any, stride: Any, _grad: Any, _hooks: Any, dtype: Any, *_rest: Any
) -> _Rebuilt:
    """torch's form for a dtype without a typed storage class: the storage in bytes, the dtype apart."""
    if not isinstance(storage, _Storage) or storage.dtype != _UNTYPED or not isinstance(dtype, _DType):
        raise DcpFormatError("a tensor record that is not a tensor of one storage")
    item = dtypes.lookup(dtype.dtype).bits // 8
    if not item or storage.numel % item:
        raise DcpFormatError(f"a {dtype.dtype} tensor record whose storage is {storage.numel} bytes")
    typed = _Storage(dtype.dtype, storage.key, storage.numel // item)
    return _rebuild_tensor_v2(typed, offset, size, stride)


class _RecordUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor_v2
        if (module, name) == ("torch._utils", "_rebuild_tensor_v3"):
            return _rebuild_tensor_v3
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        if (module, name) == ("torch.storage", "UntypedStorage"):
            return _StorageType(_UNTYPED)
        if module == "torch" and name in _TORCH_DTYPES:
            return _DType(_TORCH_DTYPES[name])
        raise DcpFormatError(f"refusing to unpickle {module}.{name} in a tensor record")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise DcpFormatError(f"a tensor record refers to {show(pid)}, not a storage")
        _, kind, key, _location, numel = pid
        if not isinstance(kind, _StorageType) or not isinstance(key, str) or not _uint(numel):
            raise DcpFormatError("a tensor record's storage reference is malformed")
        return _Storage(kind.dtype, key, numel)


def read_record(fd: int, base: int, length: int, where: object) -> RecordedTensor:
    """The tensor in the `torch.save` record at [base, base + length) of the open file `fd`."""
    head = os.pread(fd, 4, base)
    if head != b"PK\x03\x04":
        raise DcpFormatError(
            f"the record at offset {base} is not a torch.save archive (it starts {head!r}): written with "
            "FileSystemWriter(serialization_format=SAFETENSORS) or another format stagerd does not read",
            path=where,
        )
    try:
        with zipfile.ZipFile(io.BufferedReader(_Window(fd, base, length))) as z:
            members = {i.filename: i for i in z.infolist()}
            pkl = next((n for n in members if n.count("/") == 1 and n.endswith("/data.pkl")), None)
            if pkl is None:
                raise DcpFormatError(f"the record at offset {base} has no data.pkl", path=where)
            info = members[pkl]
            # zipfile reads a member in one `read` of its stored size, and inflates up to 2 GiB at once:
            # the directory's word for either, unchecked, is an allocation of that size
            if info.compress_type != zipfile.ZIP_STORED:
                raise DcpFormatError(f"the record at offset {base} has a compressed data.pkl", path=where)
            if max(info.file_size, info.compress_size) > MAX_PICKLE_BYTES:
                size = max(info.file_size, info.compress_size)
                raise DcpFormatError(f"the record at offset {base} has a {size}-byte data.pkl")
            raw = z.read(pkl)
            check_depth(raw)
            rebuilt = _RecordUnpickler(io.BytesIO(raw)).load()
            if not isinstance(rebuilt, _Rebuilt):
                raise DcpFormatError(f"the record at offset {base} holds a {type(rebuilt).__name__}")
            member = members.get(f"{pkl.removesuffix('data.pkl')}data/{rebuilt.storage.key}")
            if member is None:
                raise DcpFormatError(f"the record at offset {base} lacks its storage", path=where)
    except DcpFormatError as e:
        raise DcpFormatError(e.message, path=where) from None
    # Not only BadZipFile and UnpicklingError: an unsupported or encrypted member, deflate data that is
    # not, a BUILD on a value with no __dict__ each raise their own kind. All are damage, never a traceback.
    except Exception as e:
        raise DcpFormatError(
            f"the record at offset {base} is damaged: {type(e).__name__}: {e}", path=where
        ) from None
    return _place(fd, base, length, rebuilt, member, where)


def _place(
    fd: int, base: int, length: int, t: _Rebuilt, member: zipfile.ZipInfo, where: object
) -> RecordedTensor:
    at = f"the record at offset {base}"
    if member.compress_type != zipfile.ZIP_STORED:
        raise DcpFormatError(f"{at} is compressed: its bytes cannot be read in place", path=where)
    dt = dtypes.lookup(t.storage.dtype)
    if len(t.stride) != len(t.shape) or any(
        n > 1 and s != want for n, s, want in zip(t.shape, t.stride, _contiguous(t.shape), strict=True)
    ):
        raise DcpFormatError(
            f"{at} holds a non-contiguous tensor (size {list(t.shape)}, stride {list(t.stride)})", path=where
        )
    nbytes = dt.nbytes(math.prod(t.shape))
    skip = dt.nbytes(t.offset)
    if member.file_size != dt.nbytes(t.storage.numel) or skip + nbytes > member.file_size:
        raise DcpFormatError(f"{at}: its storage is not the size its tensor needs", path=where)
    # zipfile shifts each member by where the directory says it lies against where it was found: a damaged
    # zip64 directory offset puts a member before the record (pread: a bare EINVAL) or past it
    if not 0 <= member.header_offset <= length - _LOCAL_HEADER.size:
        raise DcpFormatError(
            f"{at}: its storage's header at {member.header_offset} lies outside the record's {length} bytes",
            path=where,
        )
    raw = os.pread(fd, _LOCAL_HEADER.size, base + member.header_offset)
    if len(raw) != _LOCAL_HEADER.size:
        raise DcpFormatError(f"{at} is truncated", path=where)
    sig, name_len, extra_len = _LOCAL_HEADER.unpack(raw)
    data = member.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    if sig != b"PK\x03\x04" or data + member.file_size > length:
        raise DcpFormatError(f"{at}: its storage runs past the record", path=where)
    return RecordedTensor(t.storage.dtype, t.shape, base + data + skip, nbytes)


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(out))


def _uint(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0
