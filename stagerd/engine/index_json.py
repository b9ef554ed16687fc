"""`model.safetensors.index.json` encoded straight from the plan's arrays.

The bytes equal `json.dumps(ExportPlan.index(), indent=2, sort_keys=True) + "\\n"`, the encoding
save_pretrained writes (a test holds them to it), without the 100k-entry dict and the string `json.dumps`
would build from it beside the plan.
"""

from __future__ import annotations

import json

from stagerd.engine.plan_types import ExportPlan


def index_json(p: ExportPlan) -> bytes:
    """The index as save_pretrained writes it: `total_parameters` and `total_size`, then the weight_map,
    keys in code point order, two-space indent."""
    names = p.chunks.names
    file_of = [fi for fi, f in enumerate(p.files) for _ in range(f.first, f.stop)]
    rows = sorted(range(p.tensor_count), key=lambda r: names[p.tensor[r]])
    out = bytearray(
        b'{\n  "metadata": {\n'
        + f'    "total_parameters": {p.total_parameters},\n    "total_size": {p.total_size}\n'.encode()
        + b'  },\n  "weight_map": '
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
