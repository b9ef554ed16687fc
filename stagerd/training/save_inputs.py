"""The inputs of one save, checked and snapshotted before anything is written.

The state dicts must hold tensors (the HF writer stores nothing else); `extras` are JSON (a dict or list,
or JSON text of an object), bytes, files, or a config object (`model.config`); the reference index is a
path or a weight_map; `dtype` one of the export engine's spellings; `metadata` JSON; the to-Hub plan
resolved from `model` (`trace`). `extras`, `reference_index`, `dtype`, `metadata` and the plan are taken
from rank 0 alone.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

from stagerd.contract import layout
from stagerd.contract.dtypes import export_dtype_hint, parse_export_dtype
from stagerd.contract.hub_plan import HubPlan
from stagerd.contract.reference_index import load_weight_map, read_reference_index
from stagerd.errors import ReferenceIndexError, SaveInputError, StagerdError
from stagerd.training.leaf_check import check_tensor, plain_tensor
from stagerd.training.to_hub import ToHub

log = logging.getLogger("stagerd.stager")

# Each part of an extra's name, in bytes: a file system's 255, less the longest temp name a writer of it
# adds (a file:// sink's `.NAME.tmp-HOST-PID-TID`, up to about 115 more).
EXTRA_PART_MAX = 128
EXTRA_NAME_MAX = 1024
# What the export writes itself (and a publish): an extra so named was dropped from both, unsaid.
_EXPORT_OWN = frozenset(
    {
        layout.INDEX_NAME,
        layout.WEIGHTS_NAME,
        layout.ADAPTER_WEIGHTS_NAME,
        f"{layout.ADAPTER_DIR}/{layout.ADAPTER_WEIGHTS_NAME}",
        layout.MANIFEST_NAME,
    }
)
_SHARD_NAME = re.compile(r"model-[0-9]+-of-[0-9]+\.safetensors")
_RENAME = "rename the extra: the export writes that file itself (the weights, their index, the manifest)"


@dataclass(frozen=True)
class Extra:
    name: str
    data: bytes | None  # JSON or raw bytes, snapshotted at save()
    source: Path | None  # a file copied at commit time


@dataclass(frozen=True)
class SaveSpec:
    """What one save writes and records, beyond the tensors."""

    step: int
    step_dir: Path
    extras: tuple[Extra, ...] = ()
    reference_index: dict[str, str] | str | None = None
    dtype: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    hub_plan: HubPlan | None = None
    adapter_plan: HubPlan | None = None


def _resolve_stateful(sd: Any, what: str) -> dict[str, Any]:
    if not isinstance(sd, Mapping):
        raise SaveInputError(f"{what} must be a mapping of names to tensors, got {type(sd).__name__}")
    # The tensor test first: the Stateful protocol check is slow, and this runs inside the stall.
    return {
        k: v if isinstance(v, torch.Tensor) or not isinstance(v, Stateful) else v.state_dict()
        for k, v in sd.items()
    }


def _check_tensors(sd: Mapping[str, Any], prefix: str = "") -> int:
    """Every leaf of the model state dict is a tensor (the HF writer cannot store anything else)."""
    n = 0
    for k, v in sd.items():
        name = f"{prefix}{k}"
        if not isinstance(k, str):
            raise SaveInputError(f"state dict key {name!r} is not a string")
        if isinstance(v, torch.Tensor):
            if not plain_tensor(name, v):
                check_tensor(name, v, "model state dict")
            n += 1
        elif isinstance(v, Mapping):
            n += _check_tensors(v, f"{name}.")
        else:
            raise SaveInputError(
                f"model state dict entry {name!r} is a {type(v).__name__}, not a tensor; "
                "put non-tensor state in optimizer_state or extras"
            )
    return n


def resolve_state(
    state_dict: Any, step: Any, optimizer_state: Any
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The model and optimizer state dicts with Stateful values resolved; the model's all tensors."""
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= layout.MAX_STEP:
        raise SaveInputError(
            f"step must be an integer from 0 to 2^63 - 1, got {step!r}",
            hint="use the training step count; a nanosecond timestamp does not fit the journal's integers",
        )
    model_sd = _resolve_stateful(state_dict, "state_dict")
    if _check_tensors(model_sd) == 0:
        raise SaveInputError("the model state dict holds no tensors")
    optim_sd = None if optimizer_state is None else _resolve_stateful(optimizer_state, "optimizer_state")
    return model_sd, optim_sd


def _check_extra_name(name: Any, shard_files: frozenset[str]) -> None:
    try:
        layout.safe_relpath(name, what="extras name", path=None)
    except StagerdError as e:
        raise SaveInputError(e.message) from None
    try:
        encoded = os.fsencode(name)
    except UnicodeEncodeError:
        raise SaveInputError(f"extras name {name!r} cannot be a file name (not encodable)") from None
    longest = max(len(part) for part in encoded.split(b"/"))
    if longest > EXTRA_PART_MAX or len(encoded) > EXTRA_NAME_MAX:
        raise SaveInputError(
            f"extras name {name[:60]!r}{'...' if len(name) > 60 else ''} is too long ({longest} bytes in "
            f"one part, {len(encoded)} in all)",
            hint=f"use at most {EXTRA_PART_MAX} bytes per part of an extras name and {EXTRA_NAME_MAX} in all",
        )
    if name in _EXPORT_OWN or name in shard_files or _SHARD_NAME.fullmatch(name):
        raise SaveInputError(f"extras {name!r} names a file the export writes itself", hint=_RENAME)
    if name.endswith(".safetensors"):
        _left_out(name)


@functools.lru_cache(maxsize=256)
def _left_out(name: str) -> None:
    """Once per name: a Trainer subclass's own safetensors file rides along with every save."""
    log.warning(
        "extras %r is kept in the step for load() but left out of its export: an export's safetensors "
        "files are the state dict's",
        name,
    )


_EXTRAS_HINT = (
    "an extra is a dict or list (saved as JSON), JSON text ('{...}'), bytes, a file path, or a config object "
    "(`model.config`, saved as save_pretrained writes it); save(..., model=model) writes config.json itself"
)


def _json_bytes(name: str, value: Any) -> bytes:
    try:
        return (json.dumps(value, indent=2) + "\n").encode()
    except (TypeError, ValueError) as e:
        raise SaveInputError(f"extras {name!r} is not JSON-serializable: {e}", hint=_EXTRAS_HINT) from None


def _extra(name: str, value: Any) -> Extra:
    """One extra's value, snapshotted now: the user-friendly reading of what `extras={name: value}` means."""
    if isinstance(value, Mapping | list):
        return Extra(name, _json_bytes(name, value), None)
    if isinstance(value, bytes | bytearray | memoryview):
        return Extra(name, bytes(value), None)
    if isinstance(value, str) and value.lstrip().startswith("{"):  # no file path does: JSON text
        try:
            json.loads(value)
        except ValueError as e:
            raise SaveInputError(f"extras {name!r} starts as JSON text but does not parse: {e}",
                                 hint=_EXTRAS_HINT) from None  # fmt: skip
        return Extra(name, value.encode(), None)
    if isinstance(value, str | os.PathLike):
        src = Path(value)
        try:
            readable = src.is_file()
        except OSError as e:  # a name too long for a path, say
            raise SaveInputError(f"extras {name!r}: {str(src)[:60]!r} is not a file path: {e.strerror}",
                                 hint=_EXTRAS_HINT) from None  # fmt: skip
        if not readable:
            raise SaveInputError(
                f"extras {name!r}: {src} is not a readable file", path=src, hint=_EXTRAS_HINT
            )
        return Extra(name, None, src.resolve())
    # transformers' PretrainedConfig and GenerationConfig: to_json_string() is what save_pretrained writes
    to_json = getattr(value, "to_json_string", None)
    if callable(to_json):
        return Extra(name, str(to_json()).encode(), None)
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        return Extra(name, _json_bytes(name, to_dict()), None)
    raise SaveInputError(f"extras {name!r}: a {type(value).__name__} cannot be saved as a file",
                         hint=_EXTRAS_HINT)  # fmt: skip


def _snapshot_extras(extras: Mapping[str, Any] | None, shard_files: frozenset[str]) -> tuple[Extra, ...]:
    out = []
    for name, value in (extras or {}).items():
        _check_extra_name(name, shard_files)
        out.append(_extra(name, value))
    names = {x.name for x in out}
    for x in out:  # `a` and `a/b`: one path cannot be both a file and a directory
        parts = x.name.split("/")
        for i in range(1, len(parts)):
            if (parent := "/".join(parts[:i])) in names:
                raise SaveInputError(
                    f"extras {parent!r} is a file, but extras {x.name!r} puts it a directory"
                )
    return tuple(out)


def _reference_index(ref: Any) -> dict[str, str] | str | None:
    """The weight_map of a path (read and checked now) or of a mapping, recorded in the marker.

    Never the path itself: a daemon in another container does not see the trainer's files, and a path
    outside the step could name a FIFO or a huge file by the time the export reads it.
    """
    if ref is None:
        return None
    if isinstance(ref, str | os.PathLike):
        return read_reference_index(ref)
    if isinstance(ref, Mapping):
        return load_weight_map(ref)
    raise ReferenceIndexError("reference_index must be a path or a weight_map {tensor name: file name}")


def describe_save(
    step: int,
    step_dir: Path,
    *,
    rank: int,
    extras: Mapping[str, Any] | None,
    reference_index: Any,
    dtype: str | None,
    metadata: Mapping[str, Any] | None,
    to_hub: ToHub | None = None,
) -> SaveSpec:
    """The save's spec; rank 0's alone carries extras, reference index, dtype and metadata."""
    if rank != 0:  # the other ranks' extras, reference_index, dtype and metadata are ignored
        return SaveSpec(step=step, step_dir=step_dir)
    try:
        json.dumps(dict(metadata or {}))
    except (TypeError, ValueError) as e:
        raise SaveInputError(f"metadata is not JSON-serializable: {e}") from None
    hub = to_hub or ToHub()
    ref = _reference_index(reference_index)
    shard_files = frozenset(ref.values()) if isinstance(ref, dict) else frozenset()
    return SaveSpec(
        step=step,
        step_dir=step_dir,
        extras=_snapshot_extras(extras, shard_files) + tuple(Extra(n, b, None) for n, b in hub.extras),
        reference_index=ref,
        dtype=export_dtype_hint(parse_export_dtype(dtype)) if dtype is not None else None,
        metadata=dict(metadata or {}),
        hub_plan=hub.plan,
        adapter_plan=hub.adapter,
    )
