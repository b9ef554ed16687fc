"""The exported `config.json` names the dtype its files hold, as `save_pretrained` writes it.

transformers 5 reads `dtype`, 4.x `torch_dtype`; the field the source config used is the one written (a
config with neither gets `dtype`). The value is the cast target after a cast, also where `--keep-dtype`
exceptions stay in another dtype (as `save_pretrained` names a mixed-dtype model by its main dtype). When
kept, the dtype the config names where the export holds any of it: `save_pretrained` names a model by its
first floating parameter's dtype, which a mixed model need not have most bytes in, and the Stager stages
config.json so named (`training/hf_config_files.py`); else (no dtype named, or a stale one the export
holds none of) the dtype holding most of the export's floating-point bytes. Every other key, and its
order, is kept; the staged original is only read.
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
    floats = _floats(dtype_bytes)
    if not floats:
        return None
    best = max(sorted(floats), key=lambda n: floats[n])
    return dtypes.lookup(best).torch_name


def exported_config(source: Path, dtype_bytes: Mapping[str, int], target: str | None = None) -> bytes | None:
    """The exported config.json's bytes, or None to copy the source unchanged (nothing to name). `target`:
    the dtype a cast names (safetensors name: the cast's, or `ExportPlan.named_dtype` where the model's
    first parameter is left uncast), None when kept."""
    cast_to = dtypes.lookup(target).torch_name if target is not None and dtype_bytes else None
    main = main_dtype(dtype_bytes)
    if (cast_to or main) is None:
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
    name = cast_to or _held(cfg.get(present[0]) if present else None, dtype_bytes) or main
    for field in present or ["dtype"]:
        cfg[field] = name
    return (json.dumps(cfg, indent=2) + "\n").encode()


def _held(named: object, dtype_bytes: Mapping[str, int]) -> str | None:
    """`named` (a config's dtype, `bfloat16`) where it is a floating dtype the export holds bytes of."""
    held = {dtypes.lookup(n).torch_name for n in _floats(dtype_bytes)}
    return named if isinstance(named, str) and named in held else None


def _floats(dtype_bytes: Mapping[str, int]) -> dict[str, int]:
    """The floating dtypes (safetensors names) the export holds bytes of, and their bytes."""
    return {n: b for n, b in dtype_bytes.items() if dtypes.lookup(n).castable and b > 0}
