"""Typed fields of a marker's JSON: each returns the value or raises TypeError (a malformed record); and
`loads`, JSON as files others write are read, and `nested_past`, how deep they may nest."""

from __future__ import annotations

import json
from typing import Any


def loads(data: str | bytes) -> Any:
    """`json.loads`, with JSON nested past the decoder's recursion limit (`[` 100k times: 100 KB) a
    ValueError like any other bad JSON: a RecursionError went past every reader's `except ValueError`."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deep") from None


def nested_past(value: Any, limit: int) -> bool:
    """Whether a decoded JSON value nests arrays and objects more than `limit` deep. The decoder takes
    nearly its whole recursion limit, and every later recursive use of the value (`json.dumps` of it from a
    deeper stack, `copy.deepcopy`, transformers' config classes) then raises RecursionError, or not, by
    how deep its caller is: a file's depth is checked once, where it is read, by this walk without
    recursion."""
    todo: list[tuple[Any, int]] = [(value, 1)] if isinstance(value, dict | list) else []
    while todo:
        v, depth = todo.pop()
        if depth > limit:
            return True
        items = v.values() if isinstance(v, dict) else v
        todo.extend((x, depth + 1) for x in items if isinstance(x, dict | list))
    return False


def as_str(x: Any) -> str:
    if not isinstance(x, str):
        raise TypeError(f"expected a string, got {type(x).__name__}")
    return x


def as_float(x: Any) -> float:
    if not isinstance(x, int | float) or isinstance(x, bool):
        raise TypeError(f"expected a number, got {x!r}")
    return float(x)


def as_bool(x: Any) -> bool:
    if not isinstance(x, bool):
        raise TypeError(f"expected true or false, got {x!r}")
    return x


def as_int(x: Any) -> int:
    if not isinstance(x, int) or isinstance(x, bool) or x < 0:
        raise TypeError(f"expected a non-negative integer, got {x!r}")
    return x


def as_strs(x: Any) -> tuple[str, ...]:
    if not isinstance(x, list):
        raise TypeError(f"expected a list of strings, got {type(x).__name__}")
    return tuple(as_str(n) for n in x)


def as_ints(x: Any) -> tuple[int, ...]:
    if not isinstance(x, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in x):
        raise TypeError(f"expected a list of integers, got {x!r}")
    return tuple(x)
