"""The declarative key mapping (contract/key_mapping.py) resolves to a to-Hub plan, or a named error."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from stagerd.contract import commit_marker
from stagerd.contract.adopt.presets import PRESETS, preset_mapping
from stagerd.contract.key_mapping import KeyMapping
from stagerd.daemon.settings_sources import load_settings
from stagerd.engine.export import mapped_plan
from stagerd.errors import ConfigError, HubPlanError

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torchtitan_llama_to_hf.json"

FUSED = {
    "strict": True,
    "rules": [
        {
            "match": r"layers\.(\d+)\.attention\.wqkv\.weight",
            "split_dim": 0,
            "split": [
                {"name": r"model.layers.\1.self_attn.q_proj.weight", "size": 8, "rope_heads": 2},
                {"name": r"model.layers.\1.self_attn.k_proj.weight", "size": 4, "rope_heads": 1},
                {"name": r"model.layers.\1.self_attn.v_proj.weight", "size": 4},
            ],
        },
        {"match": r"norm\.weight", "name": "model.norm.weight"},
    ],
}


def test_a_fused_qkv_is_split_renamed_and_rope_permuted():
    plan = KeyMapping.load(FUSED).resolve({"layers.3.attention.wqkv.weight": (16, 8), "norm.weight": (8,)})
    got = {v.name: (v.source, v.start, v.size, v.reshape, v.perm) for v in plan.views}
    src = "layers.3.attention.wqkv.weight"
    assert got == {
        "model.layers.3.self_attn.q_proj.weight": (src, (0, 0), (8, 8), (2, 2, 2, 8), (0, 2, 1, 3)),
        "model.layers.3.self_attn.k_proj.weight": (src, (8, 0), (4, 8), (1, 2, 2, 8), (0, 2, 1, 3)),
        "model.layers.3.self_attn.v_proj.weight": (src, (12, 0), (4, 8), (), ()),
        "model.norm.weight": ("norm.weight", (0,), (8,), (), ()),
    }


@pytest.mark.parametrize(
    ("spec", "shapes", "words"),
    [
        (FUSED, {"layers.0.attention.wqkv.weight": (15, 8)}, "add up to 16, not its dim 0 of 15"),
        (FUSED, {"layers.0.attention.wqkv.weight": (16, 8), "output.weight": (4, 8)}, "unmapped"),
        (
            {"rules": [{"match": r"a|b", "name": "x"}]},
            {"a": (2,), "b": (2,)},
            "two tensors are named 'x'",
        ),
        ({"rules": [{"match": "a", "name": "x", "rope_heads": 3}]}, {"a": (4, 2)}, "does not divide"),
        ({"rules": [{"match": "(", "name": "x"}]}, {}, "rule 0 is malformed"),
        # before: re.error and IndexError at the first key mapped, RecursionError at load
        ({"rules": [{"match": "w", "name": "\\1"}]}, {}, "rule 0 is malformed.*invalid group reference"),
        ({"rules": [{"match": "(?P<a>w)", "name": "\\g<b>"}]}, {}, "rule 0 is malformed.*unknown group"),
        (
            {"rules": [{"match": "w", "split": [{"name": "x", "size": 1}, {"name": "\\2", "size": 1}]}]},
            {},
            "rule 0 is malformed",
        ),
        (
            {"rules": [{"match": "(" * 1000 + ")" * 1000, "name": "x"}]},
            {},
            "rule 0's match is nested too deep",
        ),
        # before: int() made these 4 + 4 (the split "added up") and rope_heads true one head
        (
            {"rules": [{"match": "a", "split": [{"name": "x", "size": 4.9}, {"name": "y", "size": 4.1}]}]},
            {"a": (8, 2)},
            "size must be a non-negative integer, not 4.9",
        ),
        ({"rules": [{"match": "a", "name": "x", "rope_heads": True}]}, {"a": (4, 2)}, "not True"),
    ],
)
def test_bad_mappings_are_named_errors(spec, shapes, words):
    with pytest.raises(HubPlanError, match=words):
        KeyMapping.load(spec).resolve(shapes)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('{"rules": 5}', "a key mapping is"),
        ('{"rules": [{"match": "w"}]}', "rule 0 is malformed"),
        ('{"rules": [{"match": "w", "name": "\\\\1"}]}', "rule 0 is malformed"),
    ],
)
def test_a_bad_mapping_file_is_named(tmp_path, text, words):
    path = tmp_path / "mapping.json"
    path.write_text(text)
    with pytest.raises(HubPlanError, match=words) as e:
        KeyMapping.load(path)
    assert e.value.path == str(path)


def test_the_shipped_torchtitan_example_maps_every_llama_key():
    shapes = {"tok_embeddings.weight": (96, 32), "norm.weight": (32,), "output.weight": (96, 32)}
    for part, shape in {"wq": (32, 32), "wk": (16, 32), "wv": (16, 32), "wo": (32, 32)}.items():
        shapes[f"layers.0.attention.{part}.weight"] = shape
    for part, shape in {"w1": (48, 32), "w2": (32, 48), "w3": (48, 32)}.items():
        shapes[f"layers.0.feed_forward.{part}.weight"] = shape
    shapes |= {"layers.0.attention_norm.weight": (32,), "layers.0.ffn_norm.weight": (32,)}
    spec = json.loads(EXAMPLE.read_text())
    spec["rules"] = [r | {"rope_heads": 4 if "wq" in r["match"] else 2} if "rope_heads" in r else r
                     for r in spec["rules"]]  # fmt: skip
    names = {v.name for v in KeyMapping.load(spec).resolve(shapes).views}
    assert "model.layers.0.self_attn.q_proj.weight" in names and "lm_head.weight" in names
    assert len(names) == len(shapes)


MERGE = {
    "rules": [
        {"match": r"(\d+)\.w1", "name": r"layers.\1.gate_up", "concat_dim": 0, "part": 0},
        {"match": r"(\d+)\.w3", "name": r"layers.\1.gate_up", "concat_dim": 0, "part": 1},
    ]
}


def test_a_merge_concatenates_its_parts_in_order():
    plan = KeyMapping.load(MERGE).resolve({"0.w3": (6, 4), "0.w1": (6, 4)})
    got = sorted((v.name, v.source, v.at, v.whole) for v in plan.views)
    assert got == [
        ("layers.0.gate_up", "0.w1", (0, 0), (12, 4)),
        ("layers.0.gate_up", "0.w3", (6, 0), (12, 4)),
    ]


@pytest.mark.parametrize(
    ("shapes", "words"),
    [
        ({"0.w1": (6, 4), "0.w3": (6, 5)}, "do not join along dim 0"),
        ({"0.w3": (6, 4)}, r"its parts \[1\]"),
    ],
)
def test_a_merge_whose_parts_do_not_fit_is_a_named_error(shapes, words):
    with pytest.raises(HubPlanError, match=words):
        KeyMapping.load(MERGE).resolve(shapes)


def test_a_merge_keeps_the_rope_order_of_its_parts():
    """q, k and v joined into one fused qkv (Phi-3's `qkv_proj`), q and k permuted to HF's RoPE row order.
    Before: a concat rule's `rope_heads` was silently dropped, so q and k kept the trainer's row order."""
    import torch

    from tests.engine.test_views import expected

    rules = [
        {"match": r"(\d+)\.w" + p, "name": r"l.\1.qkv", "concat_dim": 0, "part": i} | heads
        for i, (p, heads) in enumerate([("q", {"rope_heads": 2}), ("k", {"rope_heads": 1}), ("v", {})])
    ]
    g = torch.Generator().manual_seed(0)
    full = {"0.wq": torch.randn(8, 3, generator=g), "0.wk": torch.randn(4, 3, generator=g)}
    full["0.wv"] = torch.randn(4, 3, generator=g)
    plan = KeyMapping.load({"rules": rules}).resolve({k: tuple(t.shape) for k, t in full.items()})

    def rope(w: torch.Tensor, heads: int) -> torch.Tensor:  # convert_llama_weights_to_hf's permute
        return w.view(heads, w.shape[0] // heads // 2, 2, w.shape[1]).transpose(1, 2).reshape(w.shape)

    want = torch.cat([rope(full["0.wq"], 2), rope(full["0.wk"], 1), full["0.wv"]])
    assert torch.equal(expected(full, plan)["l.0.qkv"], want)
    with pytest.raises(HubPlanError, match="does not divide"):
        KeyMapping.load({"rules": rules}).resolve({"0.wq": (6, 3), "0.wk": (4, 3), "0.wv": (4, 3)})


_MALFORMED = {"rules": [{"match": "w"}]}  # no name
_STRICT = {"strict": True, "rules": []}  # leaves every key unmapped


def test_a_mapping_file_the_daemon_reads_names_itself_in_every_error(tmp_path):
    """`watch --mapping FILE` reads the file, then loads the dict: its errors named no file."""
    marker = commit_marker.CommitMarker(1, 1, (), tensors={"w": commit_marker.TensorInfo("F32", (2,))})
    mapping = tmp_path / "mapping.json"
    for spec, words in ((_MALFORMED, "rule 0 is malformed"), (_STRICT, "leaves 1 saved tensors unmapped")):
        mapping.write_text(json.dumps(spec))
        with pytest.raises(HubPlanError, match=words) as e:
            mapped_plan(marker, mapping, tmp_path)
        assert e.value.path == str(mapping)


def test_a_preset_mapping_names_the_preset_in_every_error():
    titan = PRESETS["torchtitan"]
    with pytest.raises(HubPlanError, match="rule 0 is malformed") as e:
        preset_mapping(replace(titan, mapping=_MALFORMED), None)
    assert str(e.value).startswith("preset torchtitan: ")
    heads = {"num_attention_heads": 2, "num_key_value_heads": 1}
    mapping = preset_mapping(titan, heads)
    assert mapping is not None
    with pytest.raises(HubPlanError, match="unmapped") as e:
        mapping.resolve({"not.a.titan.key": (2,)})
    assert str(e.value).startswith("preset torchtitan: ")


def test_a_bad_mapping_in_the_settings_names_the_file_the_key_and_the_mapping(tmp_path, monkeypatch):
    monkeypatch.delenv("STAGERD_MAPPING", raising=False)
    mapping, settings = tmp_path / "mapping.json", tmp_path / "stagerd.toml"
    mapping.write_text(json.dumps(_MALFORMED))
    settings.write_text(f"mapping = {json.dumps(str(mapping))}\n")
    with pytest.raises(ConfigError) as e:
        load_settings(settings)
    assert str(e.value).startswith(f"{settings}: invalid settings: mapping: ")
    assert f"{mapping}: key mapping rule 0 is malformed" in str(e.value)
