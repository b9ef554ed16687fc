"""The exported `config.json` names the dtype its files hold, as `save_pretrained` writes it.

transformers 5 reads `dtype`, 4.x `torch_dtype`; the field the source config used is the one written (a
config with neither gets `dtype`). The value is the cast target after a cast, also where `--keep-dtype`
exceptions stay in another dtype (as `save_pretrained` names a mixed-dtype model by its main dtype); when
kept, the dtype holding most of the export's floating-point bytes. Every other key, and its order, is
kept; the staged original is only read.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from stagerd.contract import dtypes
from stagerd.contract.json_fields import loads
from stagerd.errors import ExtrasError

CONFIG_NAME = "config.json"
_FIELDS = ("dtype", "torch_dtype")


def main_dtype(dtype_bytes: Mapping[str, int]) -> str | None:
    """The torch name (`bfloat16`) of the floating dtype with the most bytes, or None without one."""
    floats = {n: b for n, b in dtype_bytes.items() if dtypes.lookup(n).castable and b > 0}
    if not floats:
        return None
    best = max(sorted(floats), key=lambda n: floats[n])
    return dtypes.lookup(best).torch_name


def exported_config(source: Path, dtype_bytes: Mapping[str, int], target: str | None = None) -> bytes | None:
    """The exported config.json's bytes, or None to copy the source unchanged (nothing to name). `target`:
    the cast's dtype (safetensors name), None when kept."""
    cast_to = dtypes.lookup(target).torch_name if target is not None and dtype_bytes else None
    name = cast_to or main_dtype(dtype_bytes)
    if name is None:
        return None
    try:
        cfg = loads(source.read_bytes())
    except (OSError, ValueError) as e:  # checked before the export began; a change since is an error
        # `source` may be a held file's /proc/self/fd path: the message names the file, not the number
        why = e.strerror if isinstance(e, OSError) and e.strerror else e
        raise ExtrasError(f"cannot read {CONFIG_NAME}: {why}", path=source) from None
    if not isinstance(cfg, dict):
        raise ExtrasError(f"{CONFIG_NAME} must hold a JSON object", path=source)
    present = [f for f in _FIELDS if f in cfg]
    for field in present or ["dtype"]:
        cfg[field] = name
    return (json.dumps(cfg, indent=2) + "\n").encode()
