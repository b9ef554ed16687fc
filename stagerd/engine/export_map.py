"""Which file of an export holds which tensor: its index, or the header of its one `model.safetensors`.

An export that fits one file has no index (save_pretrained writes none), so every reader of an export's
tensor list comes here rather than to the index.
"""

from __future__ import annotations

import json
from pathlib import Path

from stagerd.contract import layout
from stagerd.contract.reference_index import MAX_INDEX_BYTES
from stagerd.contract.regular_file import read_regular
from stagerd.contract.safetensors_format import read_header
from stagerd.errors import StagerdError, VerifyError


def read_weight_map(export_dir: Path) -> tuple[dict[str, str], int]:
    """(tensor name -> file name, total tensor bytes) of the export in `export_dir`."""
    listed = read_index(export_dir)
    return _single_file(export_dir) if listed is None else listed


def read_index(export_dir: Path) -> tuple[dict[str, str], int] | None:
    """The index's (weight_map, total_size), checked for shape; None where the export has no index."""
    path = export_dir / layout.INDEX_NAME
    try:
        # never a FIFO's wait (verify of an export someone else made held for good), never a read of
        # more than an index can be (a 1 TiB sparse file was a MemoryError)
        raw = read_regular(path, MAX_INDEX_BYTES + 1)
        if len(raw) > MAX_INDEX_BYTES:
            raise VerifyError(f"index is larger than {MAX_INDEX_BYTES >> 20} MiB", path=path)
        index = json.loads(raw)
        weight_map, total = index["weight_map"], index["metadata"]["total_size"]
    except FileNotFoundError:
        return None
    except RecursionError:
        raise VerifyError("unreadable index: nested too deep", path=path) from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise VerifyError(f"unreadable index: {e!r}", path=path) from None
    if not isinstance(weight_map, dict) or not isinstance(total, int) or isinstance(total, bool):
        raise VerifyError("index must hold a weight_map and an integer metadata.total_size", path=path)
    return weight_map, total


def one_file(export_dir: Path) -> Path:
    """The `model.safetensors` of an export without an index, or the error that it is not complete."""
    path = export_dir / layout.WEIGHTS_NAME
    if not path.is_file() and (export_dir / layout.ADAPTER_WEIGHTS_NAME).is_file():
        return export_dir / layout.ADAPTER_WEIGHTS_NAME
    if not path.is_file():
        raise VerifyError(
            f"neither {layout.INDEX_NAME} nor {layout.WEIGHTS_NAME}: not a complete export", path=export_dir
        )
    return path


def _single_file(export_dir: Path) -> tuple[dict[str, str], int]:
    path = one_file(export_dir)
    try:
        h = read_header(path)
    except StagerdError as e:
        raise VerifyError(f"invalid header: {e.message}", path=path) from None
    return dict.fromkeys(h.tensors, layout.WEIGHTS_NAME), h.file_size - h.data_start
