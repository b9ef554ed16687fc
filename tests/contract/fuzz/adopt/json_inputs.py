"""Fuzz inputs for the JSON a trainer leaves beside its weights (config.json, adapter_config.json,
automodel_peft_config.json, an index): the seed's tree with values replaced by wrong types, huge numbers,
huge strings and lists, nesting deep past any config's, then encoded (UTF-16, a BOM) or damaged."""

from __future__ import annotations

import json
import random
from typing import Any

from tests.contract.fuzz.adopt.inputs import INTS, SCALARS, STRS, damage

DEEP = "\x00DEEP:"  # a JSON string replaced, after encoding, by that many nested brackets


def _json_value(r: random.Random) -> Any:
    how = r.randrange(8)
    if how == 0:
        return r.choice(INTS)
    if how == 1:
        return r.choice(SCALARS)
    if how == 2:
        return f"{DEEP}{r.choice([10, 99, 100, 900, 1000, 5000, 100_000])}"
    if how == 3:
        return r.choice(STRS) * r.choice([1, 100_000])
    if how == 4:
        return [r.choice(INTS) for _ in range(r.choice([0, 1, 3]))] * r.choice([1, 10_000])
    if how == 5:
        return {r.choice(STRS): r.choice(SCALARS)}
    if how == 6:
        return r.choice([10**300, -(10**300), 2**64, 1e-320, 10**4000])
    return {}


def _paths(obj: Any, depth: int = 0) -> list[tuple[Any, Any]]:
    out: list[tuple[Any, Any]] = []
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        out.append((obj, k))
        if depth < 6:
            out += _paths(v, depth + 1)
    return out


def encode_json(r: random.Random, obj: Any) -> bytes:
    """JSON text of `obj`, its deep-nesting placeholders expanded, maybe in another encoding or damaged."""
    text = json.dumps(obj, ensure_ascii=r.random() < 0.5, indent=r.choice([None, 2]))
    while DEEP in text or "\\u0000DEEP:" in text:
        mark = "\\u0000DEEP:" if "\\u0000DEEP:" in text else DEEP
        i = text.index(mark)
        j = text.index('"', i)
        n = int(text[i + len(mark) : j])
        opener = r.choice(["[", '{"a":'])
        closer = "]" if opener == "[" else "}"
        text = text[: i - 1] + opener * n + "1" + closer * n + text[j + 1 :]
    raw = text.encode("utf-8", "surrogatepass")
    how = r.randrange(12)
    if how == 0:
        raw = text.encode("utf-16", "surrogatepass")
    elif how == 1:
        raw = b"\xef\xbb\xbf" + raw
    elif how in (2, 3):
        raw = damage(r, raw)
    return raw


def json_mutant(r: random.Random, seed: Any) -> bytes:
    """The seed's JSON tree with 1-3 of its values (or keys) replaced, dropped or wrapped, encoded."""
    obj = json.loads(json.dumps(seed))
    if r.random() < 0.05:
        obj = _json_value(r)
    for _ in range(r.choice([1, 1, 2, 3])):
        paths = _paths(obj)
        if not paths:
            break
        holder, key = r.choice(paths)
        how = r.randrange(5)
        if how == 0 and isinstance(holder, dict):
            holder.pop(key)
        elif how == 1 and isinstance(holder, dict):
            holder[r.choice([*STRS, "model_type", "num_experts", "r", "rank_pattern", "text_config"])] = (
                _json_value(r)
            )
        elif how == 2:
            holder[key] = [holder[key]] if r.random() < 0.5 else {"model_type": holder[key]}
        else:
            holder[key] = _json_value(r)
    return encode_json(r, obj)
