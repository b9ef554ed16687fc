"""The engine's bytes sort key orders names exactly as `contract.sharding.natural_key` does, and packing by
it gives `pack_by_size`'s files."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stagerd.contract.sharding import assign_with_reference, natural_key, pack_by_size
from stagerd.engine.natural_order import assign_in_natural_order, order_key, pack_in_natural_order
from stagerd.errors import ReferenceIndexError

# digits with and without leading zeros, non-ASCII decimal digits, the bytes the key escapes, separators
PARTS = [
    "a",
    "b",
    ".",
    "0",
    "00",
    "1",
    "9",
    "10",
    "007",
    "\x00",
    "\x01",
    "\x02",
    "ü",
    "٣",
    "\U0001d7d8",  # MATHEMATICAL DOUBLE-STRUCK DIGIT ZERO: a digit to \d, not to lstrip("0")
    "z",
    "_",
    "2",
]
names = st.lists(st.sampled_from(PARTS), max_size=8).map("".join)


@settings(max_examples=3000, deadline=None)
@given(names, names)
def test_order_key_compares_like_natural_key(a, b):
    assert (order_key(a) < order_key(b)) == (natural_key(a) < natural_key(b))
    assert (order_key(a) == order_key(b)) == (natural_key(a) == natural_key(b))


def test_order_key_sorts_layers_naturally():
    given_names = ["layers.10.w", "layers.2.w", "layers.02.w", "layers.2", "layers.", "layers.1.w"]
    assert sorted(given_names, key=order_key) == sorted(given_names, key=natural_key)
    assert sorted(given_names, key=order_key)[:3] == ["layers.", "layers.1.w", "layers.2"]


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(names, st.integers(0, 100), max_size=40), st.sampled_from([1, 30, 100, 250, 10**9]))
def test_packing_equals_pack_by_size(sizes, max_size):
    assert pack_in_natural_order(sizes, max_size) == pack_by_size(sizes, max_size)


FILES = ["model-00002-of-00003.safetensors", "model-00001-of-00003.safetensors", "x.safetensors", "b"]


@settings(max_examples=500, deadline=None)
@given(
    st.dictionaries(names, st.integers(0, 100), max_size=30),
    st.data(),
    st.sampled_from([1, 30, 100, 250, 10**9]),
)
def test_assignment_equals_assign_with_reference(sizes, data, max_size):
    keys = data.draw(st.lists(st.sampled_from(sorted(sizes)), unique=True) if sizes else st.just([]))
    keys += data.draw(st.lists(names, max_size=2))  # now and then a key the shards lack
    weight_map = {k: data.draw(st.sampled_from(FILES)) for k in keys}
    try:
        want = assign_with_reference(sizes, weight_map, max_size)
    except ReferenceIndexError as e:
        with pytest.raises(ReferenceIndexError) as got:
            assign_in_natural_order(sizes, weight_map, max_size)
        assert got.value.message == e.message
        return
    assert assign_in_natural_order(sizes, weight_map, max_size) == want
    unordered = assign_in_natural_order(sizes, weight_map, max_size, ordered=False)
    assert [sorted(f) for f in unordered] == [sorted(f) for f in want]  # the same files
