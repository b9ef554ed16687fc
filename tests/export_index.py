"""An export's weight map and total size as one dict, the shape of an index, whether the export has an
index (several files) or is one `model.safetensors` (no index, as save_pretrained writes it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stagerd.engine.export_map import read_weight_map


def export_index(export_dir: Path | str) -> dict[str, Any]:
    weight_map, total = read_weight_map(Path(export_dir))
    return {"metadata": {"total_size": total}, "weight_map": weight_map}
