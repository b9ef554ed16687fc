"""An adopted checkpoint against the model its config.json describes: every exported tensor of a name that
model has must have its shape there, and RoPE rows a mapping permutes must be permuted in the rows per head
that model rotates. Otherwise the export would publish, and `from_pretrained` of it would build config.json's
model (a default 7B for a config that gives only a head count), which cannot hold the weights.

The model's shapes come from the daemon (`ModelPlan.shapes`, config.json's model on the meta device, built
once per checkpoint for what it keeps in float32 anyway); this only compares. A name that model lacks is not
judged here: whether the names are the model's is the planners' question.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from stagerd.contract.hub_plan import HubPlan
from stagerd.errors import ModelShapeError

Shape = tuple[int, ...]
RAISE_ROPE = (0, 2, 1, 3)  # a mapping's `rope_heads` view: rows (head, i, pair) -> (head, pair, i)
# config.json's counts of repeated modules, by the names transformers' configs give them: its model is
# built one module per layer and per expert, on the meta device too (~3 ms and ~35 KB a decoder layer)
LAYER_FIELDS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "encoder_layers")
EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


@dataclass(frozen=True)
class ConfigShapes:
    """What config.json's model (`model`: its class) holds: per name (its own, and those its
    `save_pretrained` writes) the shapes that name may have, and the rows per head each of its rotary
    embeddings rotates (none known: empty)."""

    model: str
    shapes: Mapping[str, tuple[Shape, ...]]
    rotary: tuple[int, ...] = ()


def refuse_oversized(config: Mapping[str, Any], shapes: Mapping[str, Shape]) -> None:
    """A ModelShapeError where config.json (or a sub-model's config in it) gives its model more layers than
    the checkpoint has tensors, or more experts than that and than its largest dimension (grouped experts
    are one tensor): no model of these tensors, and one config.json's planners would take hours and
    gigabytes to build (a million layers), before any shape could be compared."""
    tensors = len(shapes)
    longest = max((d for s in shapes.values() for d in s), default=0)
    for where, c in _configs(config):
        for f in (*LAYER_FIELDS, *EXPERT_FIELDS):
            n = c.get(f)
            most = tensors if f in LAYER_FIELDS else max(tensors, longest)
            if not isinstance(n, int) or isinstance(n, bool) or n <= most:
                continue
            than = f"{tensors} tensors" + ("" if f in LAYER_FIELDS else f", none longer than {longest}")
            raise ModelShapeError(
                f"config.json's {where}{f} is {n}, but the checkpoint holds {than}: config.json describes "
                "another model"
            )


def _configs(config: Mapping[str, Any], where: str = "", depth: int = 0) -> Iterator[tuple[str, Mapping]]:
    """config.json and the sub-model configs in it (`text_config.`), two levels down."""
    yield where, config
    if depth < 2:
        for k, v in config.items():
            if isinstance(v, Mapping):
                yield from _configs(v, f"{where}{k}.", depth + 1)


def refuse_other_shapes(tensors: Iterable[tuple[str, str, Shape]], want: ConfigShapes) -> None:
    """A ModelShapeError naming the first of `tensors` (exported name, checkpoint key, shape) whose name
    config.json's model has in another shape."""
    wrong = [(n, k, s) for n, k, s in tensors if n in want.shapes and tuple(s) not in want.shapes[n]]
    if not wrong:
        return
    name, key, shape = wrong[0]
    other = f" (and {len(wrong) - 1} other tensor(s))" if len(wrong) > 1 else ""
    raise ModelShapeError(
        f"{_named(name, key)} is {list(shape)} in the checkpoint, but config.json's {want.model} gives "
        f"{list(want.shapes[name][0])}{other}: config.json describes another model"
    )


def refuse_other_rope(plan: HubPlan, want: ConfigShapes, *, mapping: bool) -> None:
    """A ModelShapeError where a view of `plan` puts RoPE rows in HF's order per head (a mapping's
    `rope_heads`) in heads of other rows than config.json's model rotates: its attention would rotate
    other rows than the trainer's did, with no shape to tell. `mapping`: the operator's --mapping gave the
    head counts, not config.json."""
    if not want.rotary:
        return
    for v in plan.views:
        if v.perm != RAISE_ROPE or len(v.reshape) != 4 or v.name not in want.shapes:
            continue
        heads, rows = v.reshape[0], 2 * v.reshape[1]
        if rows in want.rotary:
            continue
        given = "--mapping's rope_heads" if mapping else "config.json's head count"
        why = (
            "--mapping's rope_heads are not the model's" if mapping else "config.json describes another model"
        )
        raise ModelShapeError(
            f"{_named(v.name, v.source)} has its RoPE rows put in order in {heads} heads of {rows} rows "
            f"({given}), but config.json's {want.model} rotates {' or '.join(map(str, want.rotary))} "
            f"rows per head: {why}",
            hint=(
                "set each rope_heads in --mapping FILE to the model's head counts (config.json's "
                "num_attention_heads, num_key_value_heads), or pass the run's own config.json with "
                "--extras DIR; nothing was published, the trainer's files were not touched"
            )
            if mapping
            else None,
        )


def exported(plan: HubPlan) -> list[tuple[str, str, Shape]]:
    """(name, checkpoint key, shape) of each output of a plan that keeps or maps the checkpoint's names
    (its views only: a part of an output placed at an offset stands for the whole output)."""
    return [(v.name, v.source, tuple(v.whole) if v.at else tuple(v.shape)) for v in plan.views]


def _named(name: str, key: str) -> str:
    return repr(name) if name == key else f"{name!r} (checkpoint key {key!r})"
