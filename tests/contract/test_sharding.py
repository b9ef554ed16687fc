"""Output file assignment: pure functions, no I/O (and the reference index they follow, read from a file)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stagerd.contract.reference_index import load_weight_map, read_reference_index
from stagerd.contract.sharding import (
    assign_with_reference,
    natural_key,
    output_file_names,
    pack_by_size,
    pack_in_order,
    parse_size,
    reference_file_order,
)
from stagerd.errors import ReferenceIndexError


def test_natural_order():
    names = ["layers.10.w", "layers.2.w", "layers.1.w", "embed", "layers.2.b"]
    assert sorted(names, key=natural_key) == [
        "embed",
        "layers.1.w",
        "layers.2.b",
        "layers.2.w",
        "layers.10.w",
    ]


@given(st.dictionaries(st.text(max_size=8), st.integers(0, 100), max_size=30), st.integers(1, 150))
def test_pack_is_deterministic_complete_and_bounded(sizes, limit):
    files = pack_by_size(sizes, limit)
    assert files == pack_by_size(dict(reversed(list(sizes.items()))), limit)
    flat = [k for f in files for k in f]
    assert flat == sorted(sizes, key=natural_key)
    for f in files:
        assert sum(sizes[k] for k in f) <= limit or len(f) == 1


def test_reference_order_by_parsed_index_or_name():
    qwen = [f"model.safetensors-{i:05d}-of-00003.safetensors" for i in (3, 1, 2)]
    assert reference_file_order(qwen) == sorted(qwen)
    gappy = ["model-00001-of-00003.safetensors", "model-00003-of-00003.safetensors"]
    assert reference_file_order(gappy) == sorted(gappy)
    assert reference_file_order(["b.safetensors", "a.safetensors"]) == ["a.safetensors", "b.safetensors"]


def test_reference_grouping_and_leftovers():
    sizes = {"a": 4, "b": 4, "c": 4, "x.2": 3, "x.10": 3, "y": 9}
    wm = {
        "a": "pytorch_model-00002-of-00002.bin",
        "b": "pytorch_model-00001-of-00002.bin",
        "c": "pytorch_model-00001-of-00002.bin",
    }
    files = assign_with_reference(sizes, wm, max_shard_size=10)
    assert files[0] == ["b", "c"]
    assert files[1][0] == "a"
    assert files[1] == ["a", "x.2", "x.10"]  # leftovers fill the last file up to the limit...
    assert files[2] == ["y"]  # ...then new files


def test_reference_keys_missing_from_shards():
    with pytest.raises(ReferenceIndexError, match="ghost"):
        assign_with_reference({"a": 1}, {"a": "f", "ghost": "f"})


def test_load_weight_map_accepts_full_index_or_bare_map():
    assert load_weight_map({"metadata": {}, "weight_map": {"a": "f"}}) == {"a": "f"}
    assert load_weight_map({"a": "f"}) == {"a": "f"}
    with pytest.raises(ReferenceIndexError):
        load_weight_map({"weight_map": {"a": 3}})


@given(
    st.lists(st.integers(0, 90), min_size=1, max_size=30),
    st.lists(st.integers(0, 4), max_size=30),
    st.integers(1, 100),
)
def test_pack_in_order_is_huggingface_hubs_splitter(sizes, groups, limit):
    """save_pretrained's own splitter, run on the same names, sizes and shared storages: the same files in
    the same order. Group g > 0 is one storage of 50 + g bytes that every tensor marked g is a view of."""
    from huggingface_hub.serialization import split_state_dict_into_shards_factory

    names = [f"t{i:02d}" for i in range(len(sizes))][::-1]  # an order that is not the names' own
    group = {n: groups[i] if i < len(groups) else 0 for i, n in enumerate(names)}
    sd = {n: (sizes[i], group[n]) for i, n in enumerate(names)}
    theirs = split_state_dict_into_shards_factory(
        sd,
        get_storage_size=lambda t: 50 + t[1] if t[1] else t[0],
        get_storage_id=lambda t: t[1] or None,
        filename_pattern="model{suffix}.safetensors",
        max_shard_size=limit,
    )
    shared = [([n for n in names if group[n] == g], 50 + g) for g in sorted(set(group.values()) - {0})]
    ours = pack_in_order(names, {n: sd[n][0] for n in names}, limit, shared)
    assert [sorted(f) for f in ours] == [sorted(f) for f in theirs.filename_to_tensors.values()]
    assert output_file_names(len(ours)) == list(theirs.filename_to_tensors)


def test_names_and_sizes():
    assert output_file_names(1) == ["model.safetensors"]  # save_pretrained's name for one file
    assert output_file_names(2) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert parse_size("5GB") == 5 * 10**9 and parse_size("1.5MiB") == 1572864 and parse_size("77") == 77
    with pytest.raises(ValueError):
        parse_size("lots")


def test_a_reference_index_nested_too_deep_is_a_reference_index_error(tmp_path):
    """Before: RecursionError, unnamed, out of `consolidate --reference-index` and the Stager's save."""
    index = tmp_path / "model.safetensors.index.json"
    index.write_text("[" * 100_000)
    with pytest.raises(ReferenceIndexError, match="nested too deep"):
        read_reference_index(index)
