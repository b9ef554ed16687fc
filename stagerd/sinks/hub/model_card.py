"""The `README.md` model card stagerd writes for a published step, unless the export brings its own.

Pure: the card is a function of the step, the export's files and the run metadata, so a re-run renders
the same bytes. The YAML front matter comes from huggingface_hub's `ModelCardData`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCardData

from stagerd.contract.layout import INDEX_NAME
from stagerd.errors import VerifyError

CARD_NAME = "README.md"


@dataclass(frozen=True)
class CardInfo:
    """What the card says. `files` are (path, size) pairs of the export; `metadata` is the run's."""

    repo_id: str
    step: int
    files: Sequence[tuple[str, int]]
    dtype: str | None = None
    base_model: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    tag: str | None = None  # the step's tag (`REVISION/step-N` off main); default `step-N`


def export_dtypes(export_dir: Path, files: Sequence[str]) -> list[str]:
    """The distinct tensor dtypes (safetensors names, e.g. `BF16`) in the export's safetensors files.

    Reads headers only, through the safetensors library; no tensor data is loaded.
    """
    from safetensors import safe_open

    seen: set[str] = set()
    for rel in files:
        if rel.endswith(".safetensors"):
            with safe_open(str(export_dir / rel), framework="np") as f:
                seen.update(f.get_slice(k).get_dtype() for k in f.keys())  # noqa: SIM118 (not a dict)
    return sorted(seen)


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")


def _cell(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return text.replace("|", "\\|").replace("\n", " ")


def render_model_card(info: CardInfo) -> str:
    """The card's Markdown, with YAML front matter (base_model, library_name, tags)."""
    names = {path for path, _ in info.files}
    data = ModelCardData(
        base_model=info.base_model,
        library_name="transformers" if "config.json" in names else None,
        tags=["stagerd", "checkpoint"],
    )
    weights = [(p, s) for p, s in info.files if p.endswith(".safetensors")]
    tag = info.tag or f"step-{info.step}"
    total = sum(s for _, s in info.files)
    rows = [
        ("step", str(info.step)),
        ("dtype", info.dtype or "unknown"),
        ("base model", info.base_model or "not recorded"),
        ("weights", f"{len(weights)} safetensors file(s), {_human(sum(s for _, s in weights))}"),
        ("total size", _human(total)),
    ]
    if INDEX_NAME in names:
        rows.append(("index", f"`{INDEX_NAME}`"))
    lines = [
        "---",
        data.to_yaml(),
        "---",
        "",
        f"# {info.repo_id} at step {info.step}",
        "",
        f"Checkpoint of training step **{info.step}**, exported to Hugging Face safetensors and published by",
        f"stagerd. The tag `{tag}` marks this commit.",
        "",
        "| | |",
        "|---|---|",
        *(f"| {k} | {_cell(v)} |" for k, v in rows),
        "",
    ]
    if info.metadata:
        lines += ["## Run metadata", "", "| key | value |", "|---|---|"]
        lines += [f"| {_cell(k)} | {_cell(info.metadata[k])} |" for k in sorted(info.metadata)]
        lines.append("")
    lines += [
        "## Files",
        "",
        *(f"- `{p}` ({_human(s)})" for p, s in sorted(info.files)),
        "",
        "## Load",
        "",
        "```python",
        "from transformers import AutoModel",
        "",
        f'model = AutoModel.from_pretrained("{info.repo_id}", revision="{tag}")',
        "```",
        "",
    ]
    return "\n".join(lines)


def card_for_export(
    export_dir: Path,
    repo_id: str,
    files: Sequence[tuple[str, int]],
    step: int,
    metadata: dict[str, Any],
    tag: str | None = None,
) -> str:
    """The card of a step: `metadata`'s `dtype` (else the export's safetensors dtypes) and `base_model` by
    name, every other key as run metadata; `tag` the step's tag. A corrupt safetensors header is a
    VerifyError."""
    dtype = metadata.pop("dtype", None)
    if dtype is None:
        try:
            dtype = ", ".join(export_dtypes(export_dir, [path for path, _ in files])) or None
        except Exception as e:  # safetensors raises its own error type for a corrupt header
            what = f"cannot read the safetensors headers of the export: {e}"
            raise VerifyError(what, path=export_dir) from e
    info = CardInfo(
        repo_id=repo_id,
        step=step,
        files=list(files),
        dtype=str(dtype) if dtype is not None else None,
        base_model=metadata.pop("base_model", None),
        metadata=metadata,
        tag=tag,
    )
    return render_model_card(info)
