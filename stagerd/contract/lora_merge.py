"""A LoRA merge of a to-Hub plan (`HubPlan.merges`): a tensor the export engine computes from staged ones,
as PEFT's `merge_and_unload` computes it for each kind of LoRA layer.

- `LORA`: `base` + scaling * (`b` @ `a`), its transpose added with `fan_in_fan_out` (`base` is then in x
  out; a LoRA embedding is such a merge, with `delta_to_base`: PEFT's Embedding casts the delta to the
  base's dtype before adding it, a Linear adds it as it is, rounding once);
- `DORA`: W + delta as above, times `magnitude` / its L2 norm, one factor per output (a row of `base`, a
  column with `fan_in_fan_out`): PEFT's `lora_magnitude_vector` over the norm of the merged weight;
- `BIAS`: `base` + scaling * `b`, vectors (the base layer's bias and `lora_B`'s, `lora_bias=True`); no `a`;
- `EXPERTS`: a parameter PEFT adapts with `target_parameters` (its `ParamWrapper`): `base` is `experts`
  fused matrices, [experts, out, in] (`layout` `eoi`) or [experts, in, out] (`eio`), or one (out x in)
  matrix with `experts` 1; expert e's A is rows e*r..(e+1)*r of `a` (r*experts x in), its B the columns
  e, e+experts, ... of `b` (out x r*experts), and it gains scaling * (B_e @ A_e) (transposed for `eio`);
- `CAST`: `base` cast to `dtype` (torch's `.to()`, bit for bit), of its shape; no `a`, `b` or scaling:
  the trained token rows PEFT casts to the embedding's dtype before copying them in (float32 rows of a
  bf16 model under its default `autocast_adapter_dtype`), which the plan's views then read as parts.

In the marker, plain LoRA merges are written under `merges` as before; DoRA and bias merges under
`variant_merges`, expert merges under `expert_merges`, casts under `cast_merges` (`MARKER_LISTS`). An
older stagerd ignores a list it does not know: it then refuses the views that read their outputs (not
saved) rather than computing a DoRA merge as a plain one, or failing to read the whole marker on a kind
it has no name for.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from stagerd.contract.json_fields import as_bool, as_float, as_int, as_str
from stagerd.errors import HubPlanError


class MergeKind(StrEnum):
    LORA = "lora"
    DORA = "dora"
    BIAS = "bias"
    EXPERTS = "experts"
    CAST = "cast"


class ExpertLayout(StrEnum):
    """How an `EXPERTS` merge's base holds each expert's matrix (PEFT's `_did_swap_in_out_features`)."""

    EOI = "eoi"  # [experts, out, in]: transformers' fused experts (Mixtral, Qwen3-MoE)
    EIO = "eio"  # [experts, in, out]: an experts module with `is_transposed` (GPT-OSS)


# The marker's list of each kind, in the order a plan reads them back.
MARKER_LISTS: dict[str, tuple[MergeKind, ...]] = {
    "merges": (MergeKind.LORA,),
    "variant_merges": (MergeKind.DORA, MergeKind.BIAS),
    "expert_merges": (MergeKind.EXPERTS,),
    "cast_merges": (MergeKind.CAST,),
}
_CAST_DTYPES = ("F16", "BF16", "F32", "F64")


def marker_list(kind: MergeKind) -> int:
    """The place in `MARKER_LISTS` of the list that holds merges of `kind`."""
    return next(i for i, kinds in enumerate(MARKER_LISTS.values()) if kind in kinds)


@dataclass(frozen=True, slots=True)
class LoraMerge:
    """Staged tensor `name` (computed by the engine) of `kind` (see the module docstring), of `base`'s
    shape and dtype (a cast's: `dtype`)."""

    name: str
    base: str
    a: str
    b: str
    scaling: float
    fan_in_fan_out: bool = False
    kind: MergeKind = MergeKind.LORA
    magnitude: str = ""
    experts: int = 0
    layout: ExpertLayout | None = None
    delta_to_base: bool = False
    dtype: str = ""

    @property
    def inputs(self) -> tuple[str, ...]:
        """The staged tensors it reads, base first."""
        if self.kind is MergeKind.CAST:
            return (self.base,)
        if self.kind is MergeKind.BIAS:
            return (self.base, self.b)
        if self.kind is MergeKind.DORA:
            return (self.base, self.a, self.b, self.magnitude)
        return (self.base, self.a, self.b)

    def check(self, shapes: Mapping[str, tuple[int, ...]], *, path: object = None) -> None:
        """Its inputs were saved, have the ranks its kind reads, and their shapes agree."""
        if not math.isfinite(self.scaling):
            raise HubPlanError(f"merge {self.name!r}: scaling {self.scaling!r} is not finite", path=path)
        dora, bias = self.kind is MergeKind.DORA, self.kind is MergeKind.BIAS
        experts, cast = self.kind is MergeKind.EXPERTS, self.kind is MergeKind.CAST
        if cast:
            self._check_cast(shapes, path=path)
            return
        if self.dtype or (
            bool(self.magnitude) != dora
            or bool(self.a) == bias
            or (self.layout is not None, bool(self.experts)) != (experts, experts)
            or (self.delta_to_base and self.kind is not MergeKind.LORA)
        ):
            raise HubPlanError(f"merge {self.name!r}: its inputs are not a {self.kind} merge's", path=path)
        got = [shapes.get(n) for n in self.inputs]
        if any(s is None for s in got):
            raise HubPlanError(f"merge {self.name!r} reads a tensor that was not saved", path=path)
        dims = [tuple(s) for s in got if s is not None]
        if self.kind is MergeKind.BIAS:
            if len(dims[0]) != 1 or dims[1] != dims[0]:
                raise HubPlanError(
                    f"merge {self.name!r}: bias {list(dims[1])} does not fit base bias {list(dims[0])}",
                    path=path,
                )
            return
        if experts:
            self._check_experts(*dims, path=path)
            return
        w, a, b = dims[:3]
        if len(w) != 2 or len(a) != 2 or len(b) != 2:
            raise HubPlanError(f"merge {self.name!r}: base, A and B must be matrices", path=path)
        out, inp = (w[1], w[0]) if self.fan_in_fan_out else w
        if a != (b[1], inp) or b[0] != out:
            raise HubPlanError(
                f"merge {self.name!r}: A {list(a)} and B {list(b)} do not fit base {list(w)}", path=path
            )
        if self.kind is MergeKind.DORA and dims[3] != (out,):
            raise HubPlanError(
                f"merge {self.name!r}: magnitude {list(dims[3])} is not one value per output ({out})",
                path=path,
            )

    def _check_cast(self, shapes: Mapping[str, tuple[int, ...]], *, path: object) -> None:
        if self.a or self.b or self.magnitude or self.layout is not None or self.fan_in_fan_out:
            raise HubPlanError(f"merge {self.name!r}: a cast reads one tensor", path=path)
        if self.dtype not in _CAST_DTYPES:
            raise HubPlanError(f"merge {self.name!r}: cannot cast to {self.dtype!r}", path=path)
        shape = shapes.get(self.base)
        if shape is None:
            raise HubPlanError(f"merge {self.name!r} reads a tensor that was not saved", path=path)
        if len(shape) != 2:  # token rows: the engine reads a matrix by rows
            raise HubPlanError(f"merge {self.name!r}: {list(shape)} is not a matrix", path=path)

    def _check_experts(
        self, w: tuple[int, ...], a: tuple[int, ...], b: tuple[int, ...], *, path: object
    ) -> None:
        n = w[0] if len(w) == 3 else 1
        # PEFT merges one expert as a Linear, its delta out x in: an in x out base would not take it.
        eio_of_one = n == 1 and self.layout is not ExpertLayout.EOI
        if len(w) not in (2, 3) or self.experts != n or n < 1 or eio_of_one or self.fan_in_fan_out:
            raise HubPlanError(
                f"merge {self.name!r}: base {list(w)} is not {self.experts} experts' {self.layout} matrices",
                path=path,
            )
        rows, cols = w[-2:]
        out, inp = (rows, cols) if self.layout is ExpertLayout.EOI else (cols, rows)
        if len(a) != 2 or len(b) != 2 or a[0] != b[1] or a[0] % n or a[1] != inp or b[0] != out:
            raise HubPlanError(
                f"merge {self.name!r}: A {list(a)} and B {list(b)} do not fit {n} experts of base {list(w)}",
                path=path,
            )

    def to_json(self) -> dict[str, Any]:
        if self.kind is MergeKind.CAST:
            return {"name": self.name, "base": self.base, "kind": self.kind.value, "dtype": self.dtype}
        d: dict[str, Any] = {"name": self.name, "base": self.base, "a": self.a, "b": self.b}
        d["scaling"] = self.scaling
        if self.fan_in_fan_out:
            d["fan_in_fan_out"] = True
        if self.kind is not MergeKind.LORA:
            d["kind"] = self.kind.value
        if self.kind is MergeKind.BIAS:
            del d["a"]
        if self.magnitude:
            d["magnitude"] = self.magnitude
        if self.layout is not None:
            d["experts"], d["layout"] = self.experts, self.layout.value
        if self.delta_to_base:  # an older stagerd ignores it: its merge was to float rounding anyway
            d["delta_to_base"] = True
        return d

    @classmethod
    def from_json(cls, d: Any) -> LoraMerge:
        """One entry of a marker's list of merges; a defect is a KeyError, TypeError or ValueError."""
        kind = MergeKind(as_str(d.get("kind", MergeKind.LORA.value)))
        if kind is MergeKind.CAST:
            return cls(as_str(d["name"]), as_str(d["base"]), "", "", 1.0, kind=kind, dtype=as_str(d["dtype"]))
        return cls(
            as_str(d["name"]),
            as_str(d["base"]),
            "" if kind is MergeKind.BIAS else as_str(d["a"]),
            as_str(d["b"]),
            as_float(d["scaling"]),
            as_bool(d.get("fan_in_fan_out", False)),
            kind,
            as_str(d.get("magnitude", "")),
            as_int(d.get("experts", 0)),
            ExpertLayout(as_str(d["layout"])) if kind is MergeKind.EXPERTS else None,
            as_bool(d.get("delta_to_base", False)),
        )
