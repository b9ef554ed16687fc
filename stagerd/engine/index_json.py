"""`model.safetensors.index.json` encoded straight from the plan's arrays.

The bytes equal `contract.layout.write_json_atomic`'s encoding of `ExportPlan.index()` (a test holds them
to it), without the 100k-entry dict and the string `json.dumps` would build from it beside the plan.
"""

from __future__ import annotations

import json

from stagerd.engine.natural_order import order_key
from stagerd.engine.plan_types import ExportPlan, in_natural_order


def index_json(p: ExportPlan) -> bytes:
    """The index as `json.dumps(p.index(), indent=2) + "\\n"` writes it: weight_map in natural key order."""
    names = p.chunks.names
    file_of = [fi for fi, f in enumerate(p.files) for _ in range(f.first, f.stop)]
    rows: range | list[int] = range(p.tensor_count)
    if not in_natural_order(names[p.tensor[r]] for r in rows):
        rows = sorted(rows, key=lambda r: order_key(names[p.tensor[r]]))
    out = bytearray(
        f'{{\n  "metadata": {{\n    "total_size": {p.total_size}\n  }},\n  "weight_map": '.encode()
    )
    if not rows:
        out += b"{}\n}\n"
        return bytes(out)
    sep = b"{\n    "
    for r in rows:
        out += sep
        out += f"{json.dumps(names[p.tensor[r]])}: {json.dumps(p.files[file_of[r]].name)}".encode()
        sep = b",\n    "
    out += b"\n  }\n}\n"
    return bytes(out)
