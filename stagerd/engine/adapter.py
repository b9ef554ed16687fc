"""A PEFT model's adapter-only artefact, beside its merged export: what `PeftModel.save_pretrained` writes."""

from __future__ import annotations

import os
from pathlib import Path

from stagerd.contract import layout
from stagerd.contract.hub_plan import HubPlan
from stagerd.contract.layout import ADAPTER_DIR, ADAPTER_WEIGHTS_NAME
from stagerd.engine.consolidate import consolidate_into
from stagerd.engine.source import Source
from stagerd.errors import OutputError

ADAPTER_MAX_SHARD_SIZE = 1 << 62  # PEFT writes the adapter as one file, whatever its size


def build_adapter(
    source: Source, tmp: Path, plan: HubPlan, dtype: str | None, keep_dtype: str | None, threads: int
) -> tuple[str, int]:
    """A PEFT model's adapter-only artefact: `adapter/adapter_model.safetensors`, one file, no index,
    as `PeftModel.save_pretrained` writes it (its config comes with the extras)."""
    out = tmp / ADAPTER_DIR
    try:
        out.mkdir()
        res = consolidate_into(
            source.model_dir,
            out,
            listed=source.listed,
            dtype=dtype,
            keep_dtype=keep_dtype,
            max_shard_size=ADAPTER_MAX_SHARD_SIZE,
            expected=source.marker.tensors if source.marker else None,
            views=plan,
            threads=threads,
            scan=source.scan,
        )
        ((name, size),) = res.files
        os.rename(out / name, out / ADAPTER_WEIGHTS_NAME)
        layout.fsync_dir(out)
    except OSError as e:
        raise OutputError(f"cannot write the adapter: {e.strerror}", path=out) from None
    return f"{ADAPTER_DIR}/{ADAPTER_WEIGHTS_NAME}", size
