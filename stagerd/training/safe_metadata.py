"""The one pickle stagerd reads: DCP's `optim/.metadata`, through an allowlist unpickler.

`FileSystemReader.read_metadata` is a bare `pickle.load`: a staged (or restored, or downloaded)
`optim/` whose `.metadata` was replaced could run any code in every trainer that loads it. DCP's metadata
is a tree of a few dataclasses from `torch.distributed.checkpoint`, `torch.Size`, dtypes and paths;
`SafeFileSystemReader` reads it with an unpickler that resolves only those names and refuses everything
else with a `LoadError` naming the file and the refused global. Its tensors DCP reads with
`torch.load(weights_only=True)`, but its non-tensor values (an optimizer's lr, betas, step counters) go
through `DefaultLoadPlanner.load_bytes`, a `torch.load(weights_only=False)`: `SafeLoadPlanner` reads them
with torch's weights-only unpickler instead.

An allowlist does not bound how deeply plain values nest, and both unpicklers hash dict keys by recursing
in C: a key nested a million deep (1 MB) is a SIGSEGV in every rank. So every pickle is first scanned by
`contract/pickle_depth.check_depth` (in C: 0.15 s for the `.metadata` of 102,400 chunks, 4% of its
unpickle) and refused past 100 deep: the `.metadata` whole, and each record's `data.pkl` (tensor or
value) as torch's own zip reader finds it, before `torch.load` opens the record.
"""

from __future__ import annotations

import io
import pickle
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element  # the setter DefaultLoadPlanner uses
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from stagerd.contract.pickle_depth import PickleShapeError, check_depth
from stagerd.errors import LoadError

# module -> names that module may contribute; torch dtypes are allowed by value (see find_class).
_ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "Path"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "tuple", "list", "dict"}),
}

MAX_METADATA_BYTES = 256 << 20
_NOT_DCP = "this .metadata was not written by torch.distributed.checkpoint; do not load it"
_NOT_DCP_OPTIM = "this optim/ was not written by torch.distributed.checkpoint; do not load it"


class _AllowlistUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, where: str) -> None:
        super().__init__(io.BytesIO(data))
        self._where = where

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise LoadError(
            f"refusing to unpickle {module}.{name}: DCP metadata holds only checkpoint records",
            path=self._where,
            hint=_NOT_DCP,
        )


def read_dcp_metadata(data: bytes, where: str) -> Metadata:
    """DCP's `Metadata` from the bytes of a `.metadata` file, resolving only allowlisted globals."""
    try:
        check_depth(data)
    except PickleShapeError as e:
        if e.too_deep:
            raise LoadError(f"refusing DCP metadata that {e}", path=where, hint=_NOT_DCP) from None
        raise LoadError(f"DCP metadata is unreadable: {e}", path=where) from None
    try:
        meta = _AllowlistUnpickler(data, where).load()
    except LoadError:
        raise
    except Exception as e:  # truncated or garbled: a clear error, not a traceback from pickle
        raise LoadError(f"DCP metadata is unreadable: {type(e).__name__}: {e}", path=where) from None
    if not isinstance(meta, Metadata):
        raise LoadError(f"DCP metadata is a {type(meta).__name__}, not a Metadata", path=where)
    return meta


def why_refused(e: BaseException) -> str:
    """`check_torch_save`'s refusal on one line: its kind and the first line of its message."""
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"


def check_torch_save(f: IO[bytes]) -> None:
    """Raise unless `f`, from where it stands, is a torch.save archive whose `data.pkl` (found by torch's
    own zip reader, as `torch.load` finds it) nests at most 100 deep; `f` is left where it stood."""
    start = f.tell()
    # torch.load unpickles what does not start as a zip as a legacy stream of pickles, not checked here
    if f.read(4) != b"PK\x03\x04":
        raise ValueError("not a torch.save archive")
    f.seek(start)
    try:
        check_depth(torch._C.PyTorchFileReader(f).get_record("data.pkl"))
    finally:
        f.seek(start)


class SafeFileSystemReader(FileSystemReader):
    """`FileSystemReader` whose `read_metadata` goes through the allowlist unpickler, and whose records'
    pickles are checked for depth before `torch.load` reads them."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            data = f.read(MAX_METADATA_BYTES + 1)
        if len(data) > MAX_METADATA_BYTES:
            raise LoadError(f"DCP metadata is larger than {MAX_METADATA_BYTES} bytes", path=path)
        meta = read_dcp_metadata(data, str(path))
        if getattr(meta, "storage_meta", None) is None:
            meta.storage_meta = StorageMeta()
        assert meta.storage_meta is not None
        meta.storage_meta.load_id = self.load_id
        return meta

    def _slice_file(self, file: Any, sinfo: Any) -> IO[bytes]:
        view = super()._slice_file(file, sinfo)
        try:
            if sinfo.transform_descriptors:  # compressed: its pickle cannot be checked before it is read
                raise ValueError(f"it is transformed ({', '.join(sinfo.transform_descriptors)})")
            check_torch_save(view)
        except Exception as e:
            raise LoadError(
                f"refusing the record at {sinfo.offset} of {sinfo.relative_path}: {why_refused(e)}",
                path=self.path,
                hint=_NOT_DCP_OPTIM,
            ) from None
        return view


class SafeLoadPlanner(DefaultLoadPlanner):
    """`DefaultLoadPlanner` whose non-tensor values are read by torch's weights-only unpickler."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        where = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:  # pickle.UnpicklingError names the refused global
            raise LoadError(
                f"refusing the value of {where!r}: {type(e).__name__}: {str(e).splitlines()[0]}",
                path="optim/",
                hint=_NOT_DCP_OPTIM,
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[where], obj)
        else:
            self.state_dict[where] = obj
