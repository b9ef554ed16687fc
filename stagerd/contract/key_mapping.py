"""A declarative key mapping for trainers that are not transformers models (torchtitan, Megatron-style
names): regex renames, splits of fused tensors (QKV, gate/up) and the RoPE row permutation, resolved
against the staged tensors' shapes into a to-Hub plan (`hub_plan.HubPlan`).

    {"strict": true,
     "rules": [
       {"match": "tok_embeddings\\.weight", "name": "model.embed_tokens.weight"},
       {"match": "layers\\.(\\d+)\\.attention\\.wq\\.weight",
        "name": "model.layers.\\1.self_attn.q_proj.weight", "rope_heads": 32},
       {"match": "layers\\.(\\d+)\\.attention\\.wqkv\\.weight", "split_dim": 0,
        "split": [{"name": "model.layers.\\1.self_attn.q_proj.weight", "size": 4096, "rope_heads": 32},
                  {"name": "model.layers.\\1.self_attn.k_proj.weight", "size": 1024, "rope_heads": 8},
                  {"name": "model.layers.\\1.self_attn.v_proj.weight", "size": 1024}]}]}

A merge gives several keys one output: rules with the same `name`, `"concat_dim": d` and `"part": i`
(0, 1, ...) concatenate their keys along `d` in part order (`feed_forward.w1` and `w3` into a fused
`gate_up_proj`); a part's `rope_heads` puts it in HF's RoPE row order first (q, k and v into a fused qkv).

Each staged key is mapped by the first rule whose `match` matches it whole (`re.fullmatch`); `name`
templates take the match's groups (`\\1`). A key no rule matches is kept as it is, or with `strict` a
HubPlanError. `rope_heads: H` reorders the rows of each head from interleaved pairs (Meta, torchtitan) to
HF's halves, as transformers' own `convert_llama_weights_to_hf` permutes: `w.view(H, rows // H // 2, 2,
cols).transpose(1, 2).reshape(rows, cols)`. Splits must add up to the dim they split; two outputs of
one name are an error. Every error names where the mapping came from (its file, the setting, the preset).
No torch here: `stagerd watch --mapping` could resolve it as well as the Stager.
`examples/torchtitan_llama_to_hf.json` is the mapping for torchtitan's Llama 3.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from stagerd.contract.hub_plan import HubPlan, TensorView
from stagerd.contract.json_fields import loads
from stagerd.errors import HubPlanError


@dataclass(frozen=True)
class _Part:
    name: str
    size: int | None
    rope_heads: int | None


@dataclass(frozen=True)
class _Rule:
    match: re.Pattern[str]
    parts: tuple[_Part, ...]
    split_dim: int | None
    concat: tuple[int, int] | None = None  # (dim, part): this key is part `part` of its output, along `dim`


@dataclass(frozen=True)
class KeyMapping:
    rules: tuple[_Rule, ...]
    strict: bool = False
    source: str | None = field(default=None, compare=False)  # where it came from: its errors' `path`

    @classmethod
    def load(
        cls, spec: KeyMapping | Mapping[str, Any] | str | Path, *, source: str | Path | None = None
    ) -> KeyMapping:
        """From a mapping or a JSON file; a malformed spec is a HubPlanError naming the rule. `source`: where
        a mapping given as a dict came from (`preset torchtitan`, the file it was read from), named as the
        path of every error it leads to; a file names itself."""
        if isinstance(spec, KeyMapping):
            return spec
        where = None if source is None else str(source)
        if not isinstance(spec, Mapping):
            where = where or str(spec)
            try:
                spec = loads(Path(spec).read_text())
            except (OSError, ValueError) as e:
                raise HubPlanError(f"cannot read the key mapping: {e}", path=where) from None
        if not isinstance(spec, Mapping) or not isinstance(spec.get("rules"), list):
            raise HubPlanError('a key mapping is {"strict": bool, "rules": [...]}', path=where)
        rules = []
        for i, r in enumerate(spec["rules"]):
            try:
                rules.append(_rule(r))
            # IndexError: a `\g<name>` the pattern lacks; RecursionError: a `match` nested too deep
            except (KeyError, TypeError, ValueError, IndexError, re.error) as e:
                raise HubPlanError(f"key mapping rule {i} is malformed: {e!r}", path=where) from None
            except RecursionError:
                raise HubPlanError(f"key mapping rule {i}'s match is nested too deep", path=where) from None
        return cls(tuple(rules), bool(spec.get("strict", False)), where)

    def resolve(self, shapes: Mapping[str, tuple[int, ...]]) -> HubPlan:
        """The to-Hub plan of staged tensors of these global `shapes`; its errors name where it came from."""
        try:
            return self._resolve(shapes)
        except HubPlanError as e:
            if e.path is None:
                e.path = self.source
            raise

    def _resolve(self, shapes: Mapping[str, tuple[int, ...]]) -> HubPlan:
        views: list[TensorView] = []
        unmapped: list[str] = []
        joins: dict[str, list[_Join]] = {}
        for key, shape in shapes.items():
            rule = next((r for r in self.rules if r.match.fullmatch(key)), None)
            if rule is None:
                if self.strict:
                    unmapped.append(key)
                    continue
                views.append(TensorView(key, key, (0,) * len(shape), shape, shape))
                continue
            m = rule.match.fullmatch(key)
            assert m is not None
            if rule.concat is not None:
                part = _Join(rule.concat, key, shape, rule.parts[0].rope_heads)
                joins.setdefault(m.expand(rule.parts[0].name), []).append(part)
                continue
            views.extend(_views(key, shape, rule, m))
        for name, parts in joins.items():
            views.extend(_joined(name, parts))
        if unmapped:
            raise HubPlanError(
                f"the strict key mapping leaves {len(unmapped)} saved tensors unmapped: {unmapped[:5]}"
            )
        plan = HubPlan(tuple(views), (), origin="mapping")
        plan.outputs(shapes)  # two tensors of one name, boxes outside their tensor: now, at save time
        return plan


def _rule(r: Mapping[str, Any]) -> _Rule:
    match = re.compile(str(r["match"]))
    if "split" in r:
        parts = tuple(_Part(_name(p, match), _int(p["size"], "size"), _heads(p)) for p in r["split"])
        return _Rule(match, parts, _int(r.get("split_dim", 0), "split_dim"))
    concat = (_int(r["concat_dim"], "concat_dim"), _int(r["part"], "part")) if "concat_dim" in r else None
    return _Rule(match, (_Part(_name(r, match), None, _heads(r)),), None, concat)


def _name(r: Mapping[str, Any], match: re.Pattern[str]) -> str:
    """A `name` template, its group references checked against `match` now, not at the first key it
    maps: `sub` parses the whole template before it looks for a match, so no match is needed."""
    name = str(r["name"])
    match.sub(name, "")
    return name


@dataclass(frozen=True)
class _Join:
    """A key that is part `concat[1]` of its output along dim `concat[0]`."""

    concat: tuple[int, int]
    key: str
    shape: tuple[int, ...]
    rope_heads: int | None


def _joined(name: str, parts: list[_Join]) -> list[TensorView]:
    """Keys that are parts of one output, concatenated along their dim in part order (fused gate/up, or
    q, k and v into a fused qkv, each part in HF's RoPE row order where it names `rope_heads`)."""
    parts.sort(key=lambda p: p.concat[1])
    dims = {p.concat[0] for p in parts}
    order = [p.concat[1] for p in parts]
    if len(dims) != 1 or order != list(range(len(parts))):
        raise HubPlanError(
            f"{name!r}: its parts {order} along dims {sorted(dims)} are not 0..n-1 along one dim"
        )
    d = dims.pop()
    first = parts[0].shape
    if not 0 <= d < len(first) or any(
        len(p.shape) != len(first)
        or any(a != b for k, (a, b) in enumerate(zip(p.shape, first, strict=True)) if k != d)
        for p in parts
    ):
        raise HubPlanError(
            f"{name!r}: its parts' shapes {[list(p.shape) for p in parts]} do not join along dim {d}"
        )
    whole = list(first)
    whole[d] = sum(p.shape[d] for p in parts)
    out, at = [], 0
    for p in parts:
        pos = [0] * len(p.shape)
        pos[d] = at
        at += p.shape[d]
        v = TensorView(name, p.key, (0,) * len(p.shape), p.shape, p.shape)
        if p.rope_heads:  # before: silently dropped, so a fused q/k kept the trainer's row order
            v = _rope(v, p.rope_heads)
        out.append(replace(v, at=tuple(pos), whole=tuple(whole)))
    return out


def _int(x: Any, field: str) -> int:
    """A count or a dim of a rule: `int()` took 4.9 as 4 and true as 1, so a wrong split could add up."""
    if not isinstance(x, int) or isinstance(x, bool) or x < 0:
        raise ValueError(f"{field} must be a non-negative integer, not {x!r}")
    return x


def _heads(r: Mapping[str, Any]) -> int | None:
    h = r.get("rope_heads")
    if h is not None and (not isinstance(h, int) or isinstance(h, bool) or h <= 0):
        raise ValueError(f"rope_heads must be a positive integer, not {h!r}")
    return h


def _views(key: str, shape: tuple[int, ...], rule: _Rule, m: re.Match[str]) -> list[TensorView]:
    out = []
    d = rule.split_dim
    if d is not None:
        if not 0 <= d < len(shape):
            raise HubPlanError(f"{key!r}{list(shape)} has no dim {d} to split")
        sizes = [p.size or 0 for p in rule.parts]
        if sum(sizes) != shape[d]:
            raise HubPlanError(
                f"{key!r}: the split sizes {sizes} add up to {sum(sizes)}, not its dim {d} of {shape[d]}"
            )
    at = 0
    for p in rule.parts:
        name = m.expand(p.name)
        start, size = [0] * len(shape), list(shape)
        if d is not None:
            start[d], size[d] = at, p.size or 0
            at += p.size or 0
        v = TensorView(name, key, tuple(start), tuple(size), tuple(size))
        out.append(_rope(v, p.rope_heads) if p.rope_heads else v)
    return out


def _rope(v: TensorView, heads: int) -> TensorView:
    """HF's RoPE row order: rows `(h, i, pair)` become `(h, pair, i)`."""
    if len(v.size) != 2 or v.size[0] % (2 * heads):
        raise HubPlanError(f"{v.name!r}{list(v.size)}: rope_heads={heads} does not divide its rows in pairs")
    rows, cols = v.size
    reshape = (heads, rows // heads // 2, 2, cols)
    assert math.prod(reshape) == rows * cols
    return TensorView(v.name, v.source, v.start, v.size, v.shape, reshape, (0, 2, 1, 3))
