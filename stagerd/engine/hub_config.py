"""The exported `config.json` names the dtype its files hold, as `save_pretrained` writes it.

transformers 5 reads `dtype`, 4.x `torch_dtype`; the field the source config used is the one written (a
config with neither gets `dtype`). The value is the cast target after a cast, also where `--keep-dtype`
exceptions stay in another dtype (as `save_pretrained` names a mixed-dtype model by its main dtype). When
kept, the dtype the config names where the export holds any of it: `save_pretrained` names a model by its
first floating parameter's dtype, which a mixed model need not have most bytes in, and the Stager stages
config.json so named (`training/hf_config_files.py`); else (no dtype named, or a stale one the export
holds none of) the dtype holding most of the export's floating-point bytes. Every other key, and its
order, is kept (a field added goes where `save_pretrained`, which sorts the keys, would write it, in an
object whose keys are sorted); the staged original is only read.

A composite model's config (a multimodal or encoder-decoder model's) holds its sub-models' configs, each a
JSON object naming its `model_type`. `from_pretrained(dtype=...)` sets the dtype it loads in on each of
them, which `save_pretrained` then writes there too, so a cast names its target on each: also on a
sub-model the model keeps in float32, and where the model itself is named by an uncast first parameter.
A sub-config names it in the field it already has, else in the one the model's config uses (4.x writes
`torch_dtype` there too). Kept, the sub-configs are the staged ones: what `save_pretrained` of the model
as trained wrote, a dtype on each or not (a model built by its class's constructor has none). A
sub-config's own sub-configs are set only where the model's code builds that sub-model through
`from_config`, which config.json does not say: they are left as they are.
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


def exported_config(
    source: Path, dtype_bytes: Mapping[str, int], cast: str | None = None, named: str | None = None
) -> bytes | None:
    """The exported config.json's bytes, or None to copy the source unchanged (nothing to name). `cast`:
    the cast's dtype (safetensors name), None when kept; `named`: where a cast names the model by another
    dtype (`ExportPlan.named_dtype`, its first parameter left uncast), that one; its sub-configs still
    name the cast's."""
    cast_to = dtypes.lookup(cast).torch_name if cast is not None and dtype_bytes else None
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
    fields = present or ["dtype"]
    if cast_to is not None:
        _name(cfg, fields, (dtypes.lookup(named).torch_name if named is not None else None) or cast_to)
        for sub in _sub_configs(cfg):
            _name(sub, [f for f in _FIELDS if f in sub] or fields[:1], cast_to)
    elif (kept := _held(cfg.get(present[0]) if present else None, dtype_bytes) or main) is not None:
        _name(cfg, fields, kept)
    return (json.dumps(cfg, indent=2) + "\n").encode()


def _name(obj: dict[str, object], fields: list[str], dtype: str) -> None:
    """Set each of `fields` of `obj` to `dtype`; a new key goes where `save_pretrained` writes it (its keys
    sorted) in an object whose keys are sorted, else last."""
    ordered = list(obj) == sorted(obj)
    for field in fields:
        obj[field] = dtype
    if ordered:
        items = sorted(obj.items())
        obj.clear()
        obj.update(items)


def _sub_configs(cfg: dict[str, object]) -> list[dict[str, object]]:
    """The sub-model configs of a composite model's config: as transformers writes a config's
    `sub_configs`, each an object naming its `model_type`."""
    return [v for v in cfg.values() if isinstance(v, dict) and isinstance(v.get("model_type"), str)]


def _held(named: object, dtype_bytes: Mapping[str, int]) -> str | None:
    """`named` (a config's dtype, `bfloat16`) where it is a floating dtype the export holds bytes of."""
    held = {dtypes.lookup(n).torch_name for n in _floats(dtype_bytes)}
    return named if isinstance(named, str) and named in held else None


def _floats(dtype_bytes: Mapping[str, int]) -> dict[str, int]:
    """The floating dtypes (safetensors names) the export holds bytes of, and their bytes."""
    return {n: b for n, b in dtype_bytes.items() if dtypes.lookup(n).castable and b > 0}
