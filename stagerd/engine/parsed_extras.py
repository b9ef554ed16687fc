"""The extras a client parses (config.json and its kin), read bounded and checked to hold a JSON object."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stagerd.contract.json_fields import nested_past
from stagerd.contract.regular_file import open_regular, read_bounded
from stagerd.errors import ExtrasError

# Extras that from_pretrained and the serving engines parse: a broken one is an export no client loads.
PARSED_EXTRAS = frozenset({"config.json", "generation_config.json", "adapter_config.json"})
MAX_PARSED_EXTRA_BYTES = 16 << 20
# Model configs nest a sub-model's config in the model's, and a few settings in that: under 10 levels.
MAX_EXTRA_DEPTH = 64


def read_json_object(path: Path, *, named: Path | None = None, label: str | None = None) -> dict[str, Any]:
    """The JSON object `path` holds, in at most MAX_PARSED_EXTRA_BYTES; else an ExtrasError naming `named`
    (default `path`: a held file is read by its proc path), its message the file by `label` (default
    `named`'s name: a proc path's is a descriptor's number)."""
    shown = path if named is None else named
    name = label or shown.name
    try:
        with open_regular(path) as f:  # a FIFO would hold the export forever
            raw = read_bounded(f, MAX_PARSED_EXTRA_BYTES + 1)
    except OSError as e:
        raise ExtrasError(f"cannot read {name}: {e.strerror}", path=shown) from None
    if len(raw) > MAX_PARSED_EXTRA_BYTES:
        raise ExtrasError(f"{name} is over {MAX_PARSED_EXTRA_BYTES >> 20} MiB", path=shown)
    try:
        parsed = json.loads(raw)
    except RecursionError:
        raise ExtrasError(f"{name} is not valid JSON: nested too deep", path=shown) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ExtrasError(f"{name} is not valid JSON: {e}", path=shown) from None
    if not isinstance(parsed, dict):
        raise ExtrasError(f"{name} must hold a JSON object, not {type(parsed).__name__}", path=shown)
    if nested_past(parsed, MAX_EXTRA_DEPTH):  # see `nested_past`: the export, the daemon's plans use it
        raise ExtrasError(f"{name} nests its JSON over {MAX_EXTRA_DEPTH} levels deep", path=shown)
    return parsed
