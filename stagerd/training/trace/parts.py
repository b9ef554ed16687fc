"""A traced tensor made of parts: concatenations, stacks, gathers of rows, zero padding, reshapes of those.

A part is `(q, at, shape)`: its values are the elements of `q` (a strided meta view of a staged tensor)
in `q`'s row-major order, placed as the box at offset `at` of the whole; `shape` is that box's shape where
it is not `q`'s (a permuted reshape), else None. `q` None: zeros of `shape` (the padding of a
`new_zeros` + `cat`). Each part becomes one view of the plan, or one zero fill.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch

Part = tuple[torch.Tensor | None, tuple[int, ...], tuple[int, ...] | None]

# A reshape of parts is planned row by row, a row the export copies as runs of its source (one per
# element where the row is a column of it): refused beyond this many runs rather than a huge plan.
MAX_RUNS = 1 << 16


def part_shape(p: Part) -> tuple[int, ...]:
    q, _, shape = p
    if shape is not None:
        return shape
    assert q is not None
    return tuple(q.shape)


def joined(owns: Sequence[tuple[list[Part], tuple[int, ...]]], dim: int, stack: bool) -> list[Part]:
    """`torch.cat` (or `torch.stack`) along `dim` of tensors, each given as its parts and its shape."""
    out: list[Part] = []
    at = 0
    for own, shape in owns:
        for q, off, flat in own:
            if stack:
                if q is not None and flat is None:
                    with torch._C.DisableTorchFunctionSubclass():
                        q = q.unsqueeze(dim)
                if flat is not None:
                    flat = (*flat[:dim], 1, *flat[dim:])
                off = (*off[:dim], 0, *off[dim:])
            pos = list(off)
            pos[dim] += at
            out.append((q, tuple(pos), flat))
        at += 1 if stack else shape[dim]
    return out


def permuted(parts: Sequence[Part], perm: Sequence[int]) -> list[Part] | None:
    """The parts of a transpose or permute of the whole: each part's view, place and shape permuted alike.
    None where a part is a permuted reshape (its elements are in its own row-major order, not a view)."""
    out: list[Part] = []
    for q, at, flat in parts:
        if q is not None and flat is not None:
            return None
        pos = tuple(at[d] for d in perm)
        if q is None:
            assert flat is not None
            out.append((None, pos, tuple(flat[d] for d in perm)))
            continue
        with torch._C.DisableTorchFunctionSubclass():
            out.append((q.permute(*perm), pos, None))
    return out


def gathered_index(index: Any, ndim: int) -> tuple[int, list[int]] | None:
    """For `x[index]` with one list of row numbers among slices (`tensor[:, [0, 3]]`): its dim and rows."""
    items = list(index) if isinstance(index, tuple) else [index]
    lists = [i for i, a in enumerate(items) if isinstance(a, list)]
    if len(lists) != 1 or items.count(Ellipsis) > 1:
        return None
    if Ellipsis in items:
        e = items.index(Ellipsis)
        items = [*items[:e], *([slice(None)] * (ndim - len(items) + 1)), *items[e + 1 :]]
    k = next(i for i, a in enumerate(items) if isinstance(a, list))
    rows = items[k]
    ok = all(isinstance(a, slice) and a == slice(None) for i, a in enumerate(items) if i != k)
    if not ok or not rows or not all(isinstance(r, int) and not isinstance(r, bool) for r in rows):
        return None
    return k, rows


def zeros(at: tuple[int, ...], shape: tuple[int, ...]) -> Part:
    return (None, at, shape)


def _strides(shape: Sequence[int]) -> list[int]:
    out = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        out[d] = out[d + 1] * shape[d + 1]
    return out


def _unravel(i: int, shape: Sequence[int]) -> list[int]:
    return [(i // s) % n if n else 0 for s, n in zip(_strides(shape), shape, strict=True)]


def reshaped(parts: Sequence[Part], old: tuple[int, ...], new: tuple[int, ...]) -> list[Part] | None:
    """The parts of the same values laid out as `new` (row-major, as `reshape` does), or None if the
    export would copy them as more than MAX_RUNS runs. Each piece is a run of one row of a part that stays
    in one row of the new layout: a 1-dim view of the staged tensor, or zeros."""
    out: list[Part] = []
    runs = 0
    so = _strides(old)
    row = new[-1] if new else 1
    for q, at, flat in parts:
        shape = part_shape((q, at, flat))
        if math.prod(shape) == 0:
            continue
        qshape = tuple(q.shape) if q is not None else shape
        qrow = qshape[-1] if qshape else 1
        sp = _strides(shape)
        width = shape[-1] if shape else 1
        for idx in itertools.product(*(range(n) for n in shape[:-1])):
            o = sum((a + i) * s for a, i, s in zip(at, (*idx, 0), so, strict=True))
            r = sum(i * s for i, s in zip((*idx, 0), sp, strict=True))
            done = 0
            while done < width:
                n = min(width - done, row - (o + done) % row, qrow - (r + done) % qrow)
                pos = tuple(_unravel(o + done, new))
                box = (*(1 for _ in new[:-1]), n) if new else ()
                piece = _piece(q, r + done, n, qshape, pos, box)
                out.append(piece)
                done += n
                seg = piece[0]
                runs += n if seg is not None and seg.dim() and seg.stride(-1) != 1 else 1
                if runs > MAX_RUNS:
                    return None
    return out


def _piece(
    q: torch.Tensor | None,
    r: int,
    n: int,
    qshape: tuple[int, ...],
    pos: tuple[int, ...],
    box: tuple[int, ...],
) -> Part:
    """Elements [r, r + n) of `q`, in its row-major order and within one of its rows, as `box` at `pos`."""
    if q is None:
        return (None, pos, box)
    i = _unravel(r, qshape)
    with torch._C.DisableTorchFunctionSubclass():
        seg = q[tuple(i[:-1])].narrow(0, i[-1], n) if qshape else q
        seg = seg.reshape(box) if seg.dim() != len(box) else seg
    return (seg, pos, None)
