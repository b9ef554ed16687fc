"""The one pickle stagerd reads: DCP's `optim/.metadata`, through an allowlist unpickler.

`FileSystemReader.read_metadata` is a bare `pickle.load`: a staged (or restored, or downloaded)
`optim/` whose `.metadata` was replaced could run any code in every trainer that loads it. DCP's metadata
is a tree of a few dataclasses from `torch.distributed.checkpoint`, `torch.Size`, dtypes and paths;
`SafeFileSystemReader` reads it with an unpickler that resolves only those names and refuses everything
else with a `LoadError` naming the file and the refused global. Its tensors DCP reads with
`torch.load(weights_only=True)`, but its non-tensor values (an optimizer's lr, betas, step counters) go
through `DefaultLoadPlanner.load_bytes`, a `torch.load(weights_only=False)`: `SafeLoadPlanner` reads them
with torch's weights-only unpickler instead.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element  # the setter DefaultLoadPlanner uses
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

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
            hint="this .metadata was not written by torch.distributed.checkpoint; do not load it",
        )


def read_dcp_metadata(data: bytes, where: str) -> Metadata:
    """DCP's `Metadata` from the bytes of a `.metadata` file, resolving only allowlisted globals."""
    try:
        meta = _AllowlistUnpickler(data, where).load()
    except LoadError:
        raise
    except Exception as e:  # truncated or garbled: a clear error, not a traceback from pickle
        raise LoadError(f"DCP metadata is unreadable: {type(e).__name__}: {e}", path=where) from None
    if not isinstance(meta, Metadata):
        raise LoadError(f"DCP metadata is a {type(meta).__name__}, not a Metadata", path=where)
    return meta


class SafeFileSystemReader(FileSystemReader):
    """`FileSystemReader` whose `read_metadata` goes through the allowlist unpickler."""

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
                hint="this optim/ was not written by torch.distributed.checkpoint; do not load it",
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[where], obj)
        else:
            self.state_dict[where] = obj
