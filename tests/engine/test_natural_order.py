"""The engine's bytes sort key orders names exactly as `contract.sharding.natural_key` does, and packing by
it gives `pack_by_size`'s files."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from stagerd.contract.sharding import natural_key, pack_by_size
from stagerd.engine.natural_order import order_key, pack_in_natural_order

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
