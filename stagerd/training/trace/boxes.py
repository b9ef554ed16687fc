"""Turn a traced tensor (a strided view of a staged tensor) into the box of it the plan declares.

`box_of`: a view read in row-major order is a box of its source (`TensorView`), or, where its dims
permute the box's (a Transpose), a permuted view. `flat_box`: a reshape that copies a strided view
(PermuteForRope's rows regrouped per head) as a permuted view of the box it reads. No allocation: the
tensors are meta views.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import torch

from stagerd.contract.hub_plan import TensorView
from stagerd.errors import HubPlanError


def strides(shape: tuple[int, ...]) -> list[int]:
    out = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        out[d] = out[d + 1] * shape[d + 1]
    return out


def _view(name: str, source: str, p: torch.Tensor, root_shape: tuple[int, ...]) -> TensorView | None:
    """`p` (a view of the root) as a box of it read in row-major order, or None if it is not one."""
    rs = strides(root_shape)
    rem, start = p.storage_offset(), []
    for d, n in enumerate(root_shape):
        start.append((rem // rs[d]) % n if n else 0)
    if sum(a * s for a, s in zip(start, rs, strict=True)) != p.storage_offset():
        return None
    size = [1] * len(root_shape)
    order: list[int] = []  # the root dim of each non-unit dim of `p`
    for n, st in zip(p.shape, p.stride(), strict=True):
        if n == 1:
            continue
        found = next((d for d in range(len(root_shape)) if root_shape[d] > 1 and rs[d] == st), None)
        if found is None or found in order or start[found] + n > root_shape[found]:
            return None
        size[found] = n
        order.append(found)
    if order == sorted(order):
        return TensorView(name, source, tuple(start), tuple(size), tuple(p.shape))
    # The box's dims permuted (a Transpose): moved by source lines, see engine/views.py.
    dims = sorted(order)
    reshape, perm = tuple(size[d] for d in dims), tuple(dims.index(d) for d in order)
    return TensorView(name, source, tuple(start), tuple(size), tuple(p.shape), reshape, perm)


def box_of(name: str, p: torch.Tensor, source_of: Mapping[int, str], origin: str) -> TensorView:
    base = p._base if p._base is not None else p
    source = source_of[id(base)]
    v = _view(name, source, p, tuple(base.shape))
    if v is None:
        raise HubPlanError(
            f"{name!r}: the {origin} conversion reorders the elements of {source!r} (shape "
            f"{list(p.shape)}, strides {list(p.stride())}): not a box, cannot be planned as byte moves"
        )
    return v


def flat_box(
    name: str, p: torch.Tensor, shape: tuple[int, ...], source_of: Mapping[int, str], origin: str
) -> TensorView:
    """Output `name` of `shape`: the elements of `p` (a strided view of a root) in `p`'s row-major order.
    Planned where `p`'s dims, ordered by stride, tile a contiguous range of the root that is a box of it
    (whole trailing rows): the box read in row-major order, viewed as those dims (`reshape`), permuted back
    to `p`'s order (`perm`). PermuteForRope's rows regrouped per head are this."""
    base = p._base if p._base is not None else p
    source, root = source_of[id(base)], tuple(base.shape)
    st = [int(x) for x in p.stride()]
    dims = sorted((d for d in range(p.dim()) if p.shape[d] != 1), key=lambda d: -st[d])
    ok = bool(dims) and st[dims[-1]] == 1
    for a, b in itertools.pairwise(dims):
        ok = ok and st[a] == st[b] * p.shape[b]
    box = _range_box(int(p.storage_offset()), p.numel(), root) if ok else None
    if box is None:
        raise HubPlanError(
            f"{name!r}: the {origin} conversion reshapes {source!r} (shape {list(p.shape)}, strides "
            f"{list(p.stride())}) into an order that is not a permutation of a box: cannot be planned"
        )
    start, size = box
    reshape = tuple(p.shape[d] for d in dims)
    perm = tuple(dims.index(d) for d in range(p.dim()) if p.shape[d] != 1)
    if perm == tuple(range(len(perm))):
        reshape, perm = (), ()
        if [k for k in size if k != 1] != [k for k in shape if k != 1]:
            raise HubPlanError(f"{name!r}: a reshape of {source!r} that is not its box: cannot be planned")
    return TensorView(name, source, start, size, shape, reshape, perm)


def _range_box(off: int, n: int, root: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The box of `root` that is the row-major range [off, off + n), if one is."""
    rs = strides(root)
    for k in range(len(root)):
        if n % rs[k] or off % rs[k]:
            continue
        m = n // rs[k]
        start = [(off // rs[d]) % root[d] for d in range(len(root))]
        if start[k] + m <= root[k] and all(start[d] == 0 for d in range(k + 1, len(root))):
            return tuple(start), tuple([*(1 for _ in range(k)), m, *root[k + 1 :]])
    return None
