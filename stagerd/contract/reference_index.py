"""The reference index: a `model.safetensors.index.json` whose file grouping an export keeps.

One home for reading and validating it, used by the Stager (at save time) and the export engine.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping

from stagerd.contract.regular_file import read_bounded
from stagerd.errors import ReferenceIndexError

# A real index is a few MB even for 100k tensors; anything bigger is not an index.
MAX_INDEX_BYTES = 64 * 1024 * 1024


def load_weight_map(index: Mapping[str, object] | None, *, path: object = None) -> dict[str, str] | None:
    """Accept a full `model.safetensors.index.json` object or a bare weight_map; validate it."""
    if index is None:
        return None
    wm = index.get("weight_map", index) if isinstance(index, Mapping) else None
    if not isinstance(wm, Mapping) or not wm:
        raise ReferenceIndexError("reference index has no weight_map", path=path)
    if not all(isinstance(k, str) and isinstance(v, str) and v for k, v in wm.items()):
        raise ReferenceIndexError("weight_map must map tensor names to file names", path=path)
    return dict(wm)


def read_reference_index(path: str | os.PathLike[str]) -> dict[str, str]:
    """The weight_map of a reference index file: a regular file of bounded size, never a FIFO or device."""
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; fstat then refuses it.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ReferenceIndexError("reference index not found", path=path) from None
    except OSError as e:
        raise ReferenceIndexError(f"cannot read reference index: {e}", path=path) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ReferenceIndexError("reference index is not a regular file", path=path)
        if st.st_size > MAX_INDEX_BYTES:
            raise ReferenceIndexError(
                f"reference index is {st.st_size} bytes, over the {MAX_INDEX_BYTES} byte limit", path=path
            )
        with os.fdopen(fd, "rb", closefd=True) as f:
            fd = -1
            raw = read_bounded(f, MAX_INDEX_BYTES + 1)
        obj = json.loads(raw)
    except ReferenceIndexError:
        raise
    except (OSError, ValueError) as e:
        raise ReferenceIndexError(f"cannot read reference index: {e}", path=path) from None
    except RecursionError:
        raise ReferenceIndexError("reference index is JSON nested too deep", path=path) from None
    finally:
        if fd >= 0:
            os.close(fd)
    wm = load_weight_map(obj, path=path)
    assert wm is not None
    return wm
