"""The export engine on real DCP saves: bit-exact values, layouts, casts, and the CLI."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from stagerd.contract import commit_marker, layout
from stagerd.engine.consolidate import consolidate_into
from stagerd.engine.export import export_step
from stagerd.engine.verify import verify_export
from tests.cli_helpers import run_cli
from tests.export_index import export_index

CASTABLE = {torch.float32, torch.float16, torch.bfloat16, torch.float64}


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def load_export(d: Path) -> dict[str, torch.Tensor]:
    index = export_index(d)
    out = {}
    for name, fname in index["weight_map"].items():
        with safe_open(d / fname, "pt") as f:
            out[name] = f.get_tensor(name)
    return out


def assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, ref in want.items():
        t = got[name]
        assert t.dtype == ref.dtype, name
        assert tuple(t.shape) == tuple(ref.shape), name
        assert _bytes(t) == _bytes(ref), name


def expected_cast(full, dtype: torch.dtype | None, keep: str | None = None):
    import re

    out = {}
    for k, v in full.items():
        cast = dtype is not None and v.dtype in CASTABLE and not (keep and re.search(keep, k))
        out[k] = v.to(dtype) if cast else v
    return out


@pytest.mark.parametrize("fixture", ["dcp_mixed", "dcp_mixed2"])
def test_keep_dtype_is_bit_exact(request, tmp_path, fixture):
    src, full = request.getfixturevalue(fixture)
    consolidate_into(src, tmp_path)
    assert_bit_exact(load_export(tmp_path), full)


@pytest.mark.parametrize(
    ("name", "dtype"), [("BF16", torch.bfloat16), ("F16", torch.float16), ("F32", torch.float32)]
)
def test_cast_equals_torch_to(dcp_mixed, tmp_path, name, dtype):
    src, full = dcp_mixed
    consolidate_into(src, tmp_path, dtype=name, keep_dtype=r"layernorm|mlp\.gate")
    got = load_export(tmp_path)
    assert_bit_exact(got, expected_cast(full, dtype, r"layernorm|mlp\.gate"))
    assert got["model.fp8_e4m3"].dtype == torch.float8_e4m3fn  # fp8, ints and bool never change
    assert got["model.ids_i64"].dtype == torch.int64
    assert got["model.mask"].dtype == torch.bool


def test_gathered_tensors_cast_through_bounded_buffers(dcp_mixed, tmp_path, monkeypatch):
    """A buffer far smaller than any tensor forces many slabs and cast rounds; values stay exact."""
    from stagerd.engine import limits

    monkeypatch.setattr(limits, "BUFFER_BYTES", 64)
    src, full = dcp_mixed
    consolidate_into(src, tmp_path, dtype="BF16")
    assert_bit_exact(load_export(tmp_path), expected_cast(full, torch.bfloat16))


@pytest.mark.parametrize("dtype", [None, "BF16"])
def test_packed_tiny_tensors_write_the_bytes_of_one_move_each(dcp_mixed, tmp_path, monkeypatch, dtype):
    """Every tensor here is tiny, so runs of them go as one move each (engine/pack.py); the files equal
    those written with packing off (a move per block), packs cut at a few pieces or at any size."""
    from stagerd.engine import limits
    from stagerd.engine.consolidate import plan, scan_shards
    from stagerd.engine.moves import plan_moves

    src, _ = dcp_mixed
    outs = {}
    for case, tensor, pieces in (("off", 0, 4096), ("few pieces", 1 << 18, 3), ("default", 1 << 18, 4096)):
        monkeypatch.setattr(limits, "PACK_TENSOR", tensor)
        monkeypatch.setattr(limits, "PACK_PIECES", pieces)
        outs[case] = tmp_path / case.replace(" ", "-")
        outs[case].mkdir()
        consolidate_into(src, outs[case], dtype=dtype, max_shard_size=4096)
        p = plan(scan_shards(src), dtype=dtype, max_shard_size=4096)
        outs[case, "moves"] = sum(1 for _ in plan_moves(p))
        verify_export(outs[case], src)  # compare() runs the same packs
    assert outs["default", "moves"] < outs["few pieces", "moves"] < outs["off", "moves"]
    for f in sorted(outs["off"].iterdir()):
        assert (
            f.read_bytes()
            == (outs["default"] / f.name).read_bytes()
            == (outs["few pieces"] / f.name).read_bytes()
        )


def test_output_files_and_index_agree(dcp_mixed, tmp_path):
    src, full = dcp_mixed
    res = consolidate_into(src, tmp_path, max_shard_size=2000)
    index = export_index(tmp_path)
    names = sorted({f for f in index["weight_map"].values()})
    n = len(names)
    assert n == len(res.files) > 1
    assert names == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in full.values())
    for fname in names:
        raw = (tmp_path / fname).read_bytes()
        hlen = int.from_bytes(raw[:8], "little")
        assert (8 + hlen) % 8 == 0
        header = json.loads(raw[8 : 8 + hlen])
        assert header["__metadata__"] == {"format": "pt"}
        assert {k for k in header if k != "__metadata__"} == {
            k for k, v in index["weight_map"].items() if v == fname
        }
    verify_export(tmp_path, src)


def test_index_is_what_save_pretrained_writes(dcp_mixed, tmp_path):
    """save_pretrained's index: `total_parameters` (its num_parameters(): the elements of what it saves) and
    `total_size`, keys in code point order (`sort_keys`), two-space indent. Before: no total_parameters,
    the weight_map in natural order."""
    src, full = dcp_mixed
    consolidate_into(src, tmp_path, max_shard_size=2000)
    raw = (tmp_path / layout.INDEX_NAME).read_text()
    index = json.loads(raw)
    assert index["metadata"]["total_parameters"] == sum(t.numel() for t in full.values())
    assert raw == json.dumps(index, indent=2, sort_keys=True) + "\n"
    assert list(index["weight_map"]) == sorted(full)


def test_one_file_is_the_bytes_safetensors_writes(dcp_mixed, tmp_path):
    """save_pretrained writes each file with safetensors' `save_file(..., metadata={"format": "pt"})`: dtypes
    in its enum order (I64 before F64, BF16 before F16, I32 after F32), names in code point order
    (`layers.10` before `layers.2`). Before: widest first, then natural order, so other bytes."""
    from safetensors.torch import save_file

    src, full = dcp_mixed
    consolidate_into(src, tmp_path, max_shard_size=1 << 40)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]  # and no index, as theirs
    got = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in full.items()}, tmp_path / "ref.st", metadata={"format": "pt"})
    assert got.read_bytes() == (tmp_path / "ref.st").read_bytes()
    verify_export(tmp_path, src)


def test_packing_is_natural_order_and_deterministic(dcp_mixed, tmp_path):
    src, _ = dcp_mixed
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    consolidate_into(src, a, max_shard_size=1500)
    consolidate_into(src, b, max_shard_size=1500)
    for f in sorted(p.name for p in a.iterdir()):
        assert (a / f).read_bytes() == (b / f).read_bytes()
    wm = export_index(a)["weight_map"]
    file_of = {k: int(v.split("-")[1]) for k, v in wm.items()}
    assert file_of["model.layers.2.conv.weight"] <= file_of["model.layers.10.mlp.down_proj.weight"]


@pytest.mark.parametrize(
    "pattern",
    [
        "model-{i:05d}-of-{n:05d}.safetensors",
        "model.safetensors-{i:05d}-of-{n:05d}.safetensors",
        "pytorch_model-{i:05d}-of-{n:05d}.bin",
        "weights_{name}.safetensors",
    ],
)
def test_reference_index_grouping_kept(dcp_mixed, tmp_path, pattern):
    src, full = dcp_mixed
    keys = sorted(full)
    groups = {0: keys[:5], 1: keys[5:12], 2: keys[12:-2]}  # the last two keys are absent from the reference
    names = ["zeta", "alpha", "mid"]
    wm = {k: pattern.format(i=gi + 1, n=3, name=names[gi]) for gi, ks in groups.items() for k in ks}
    out = tmp_path / "out"
    out.mkdir()
    consolidate_into(src, out, reference=wm, max_shard_size=10**9)
    got = export_index(out)["weight_map"]
    # parsed k-of-N indices give the order; otherwise the sorted file names do
    order = [0, 1, 2] if "{i" in pattern else sorted(range(3), key=lambda gi: names[gi])
    for pos, gi in enumerate(order):
        for k in groups[gi]:
            assert got[k] == f"model-{pos + 1:05d}-of-00003.safetensors"
    for k in keys[-2:]:
        assert got[k] == "model-00003-of-00003.safetensors"  # extras packed into the last file
    assert_bit_exact(load_export(out), full)


def test_reference_key_missing_from_shards_is_an_error(dcp_mixed, tmp_path):
    from stagerd.errors import ReferenceIndexError

    src, full = dcp_mixed
    wm = dict.fromkeys(full, "a.safetensors") | {"not.in.shards": "a.safetensors"}
    with pytest.raises(ReferenceIndexError, match=r"not\.in\.shards"):
        consolidate_into(src, tmp_path, reference=wm)


def test_export_step_with_extras_and_marker(step_dir, dcp_mixed):
    _, full = dcp_mixed
    res = export_step(step_dir, dtype="bf16")
    assert not res.skipped
    assert not (step_dir / layout.EXPORT_TMP_DIR).exists()
    exp = step_dir / layout.EXPORT_DIR
    # The config names the dtype the files hold (issue 12); the staged original stays as it was.
    assert json.loads((exp / "config.json").read_text()) == {"model_type": "tiny", "dtype": "bfloat16"}
    assert (step_dir / layout.EXTRAS_DIR / "config.json").read_text() == '{"model_type": "tiny"}\n'
    assert (exp / "tokenizer.json").exists()
    assert_bit_exact(load_export(exp), expected_cast(full, torch.bfloat16))
    assert dict(res.files)["config.json"] == (exp / "config.json").stat().st_size
    again = export_step(step_dir, dtype="bf16")
    assert again.skipped and again.files == res.files
    verify_export(exp, step_dir)
    # With --keep-dtype exceptions (here most of the bytes), the config still names the export dtype.
    export_step(step_dir, dtype="bf16", keep_dtype="embed_tokens|lm_head")
    assert json.loads((exp / "config.json").read_text())["dtype"] == "bfloat16"


def test_export_step_rebuilds_after_a_crash(step_dir, dcp_mixed):
    _, full = dcp_mixed
    stale = step_dir / layout.EXPORT_TMP_DIR
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    export_step(step_dir)
    assert not stale.exists()
    assert_bit_exact(load_export(step_dir / layout.EXPORT_DIR), full)


def test_marker_dtype_hint_applies(step_dir, dcp_mixed):
    m = commit_marker.read_marker(step_dir)
    commit_marker.write_marker(step_dir, commit_marker.CommitMarker(**{**m.__dict__, "dtype": "fp16"}))
    export_step(step_dir)
    assert load_export(step_dir / layout.EXPORT_DIR)["lm_head.weight"].dtype == torch.float16


def test_verify_catches_a_flipped_byte(step_dir):
    from stagerd.errors import VerifyError

    export_step(step_dir)
    exp = step_dir / layout.EXPORT_DIR
    f = exp / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0xFF
    f.write_bytes(bytes(raw))
    verify_export(exp)  # structure is still fine
    with pytest.raises(VerifyError, match="differ"):
        verify_export(exp, step_dir)


def test_verify_names_the_tensor_of_a_wrong_byte_inside_a_pack(step_dir):
    """Runs of tiny tensors are compared as one move (engine/pack.py): a wrong byte is named by the tensor
    that holds it, and where in it, not only by its file offset."""
    from stagerd.errors import VerifyError

    export_step(step_dir)
    f = step_dir / layout.EXPORT_DIR / "model.safetensors"
    raw = bytearray(f.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__")
    name, begin = sorted(
        (k, v["data_offsets"][0])
        for k, v in header.items()
        if v["data_offsets"][1] > v["data_offsets"][0] + 3
    )[-1]
    raw[8 + n + begin + 3] ^= 0x01
    f.write_bytes(bytes(raw))
    with pytest.raises(VerifyError) as e:
        verify_export(f.parent, step_dir)
    assert f"tensor {name!r} (its byte 3) differs" in e.value.message
    assert f"file offset {8 + n + begin + 3}" in e.value.message


def test_matches_torch_consolidation_on_float_tensors(tmp_path):
    """Same values as torch's own consolidate_safetensors_files where torch can run (floats only)."""
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

    from tests.dcp_fixtures import dcp_save, float_tensors

    src = tmp_path / "src"
    dcp_save(src, world=2, builder=float_tensors)
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir()
    theirs.mkdir()
    consolidate_into(src, ours)
    consolidate_safetensors_files(
        str(src), str(theirs), fqn_to_index_mapping=dict.fromkeys(float_tensors(), 1)
    )
    with safe_open(theirs / "model-00001-of-00001.safetensors", "pt") as f:  # torch's own naming
        ref = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    got = load_export(ours)
    # torch 2.13 writes zeros for 0-dim tensors; ours hold the saved value (test_keep_dtype_is_bit_exact).
    scalars = {k for k, v in got.items() if v.dim() == 0}
    assert scalars and all(got[k].item() != 0 for k in scalars)
    assert_bit_exact(
        {k: v for k, v in got.items() if k not in scalars}, {k: ref[k] for k in ref if k not in scalars}
    )


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(args)


def test_cli_consolidate_and_verify(step_dir, tmp_path, dcp_mixed):
    out = tmp_path / "cli-out"
    r = _cli("consolidate", str(step_dir), str(out), "--dtype", "bf16", "--max-shard-size", "3kB")
    assert r.returncode == 0, r.stderr
    assert (out / "config.json").exists()
    assert len(list(out.glob("*.safetensors"))) > 1
    assert_bit_exact(load_export(out), expected_cast(dcp_mixed[1], torch.bfloat16))
    r = _cli("verify", str(out), "--against", str(step_dir))
    assert r.returncode == 0, r.stderr
    assert "every byte equal" in r.stdout
