"""One training run per model, shared by every assertion about it; its exports; the comparisons.

`run(kind, tmp)` trains and saves on 2 gloo ranks (`ranks.train_and_save`), then exports the one step
twice with `stagerd watch ROOT --sink file://... --once`: with the dtype kept, and with `--dtype bf16`
(from a copy of ROOT made before either watch ran, so each daemon has its own journal).
"""

from __future__ import annotations

import difflib
import json
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stagerd.contract import layout
from tests.cli_helpers import run_cli
from tests.daemon_helpers import fast_flags
from tests.fidelity import ranks
from tests.gloo import launch


@dataclass(frozen=True)
class Run:
    kind: str
    root: Path
    ref: Path  # keep/ and bf16/: save_pretrained of the gathered model; *.logits.pt
    exports: dict[str, Path]  # "keep" / "bf16" -> the published step directory


def export(root: Path, sink: Path, *flags: str) -> Path:
    res = run_cli(["watch", root, "--sink", f"file://{sink}", "--once", *fast_flags(), *flags])
    assert res.returncode == 0, res.stdout + res.stderr
    return sink / layout.step_dir_name(ranks.STEP)


def run(kind: str, tmp: Path, **train: Any) -> Run:
    root, ref = tmp / "root", tmp / "ref"
    ref.mkdir(parents=True)
    launch(ranks.train_and_save, kind, str(root), str(ref), train, deadline_s=240)
    shutil.copytree(root, tmp / "root_bf16")
    exports = {
        "keep": export(root, tmp / "out"),
        "bf16": export(tmp / "root_bf16", tmp / "out_bf16", "--dtype", "bf16"),
    }
    return Run(kind, root, ref, exports)


def tensors(d: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """name -> (dtype, shape, bytes) of every tensor in the safetensors files of `d`, read raw."""
    out: dict[str, tuple[str, tuple[int, ...], bytes]] = {}
    for f in sorted(d.glob("*.safetensors")):
        raw = f.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        header.pop("__metadata__", None)
        for name, e in header.items():
            assert name not in out, f"{name} in two files"
            b, end = e["data_offsets"]
            out[name] = (e["dtype"], tuple(e["shape"]), raw[8 + n + b : 8 + n + end])
    return out


def flip_byte(export: Path, name: str, at: int = 5) -> None:
    """Flip one bit of byte `at` of tensor `name` in the export's file of it, for `verify` to find."""
    weight_map = json.loads((export / layout.INDEX_NAME).read_text())["weight_map"]
    f = export / weight_map[name]
    raw = bytearray(f.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    begin = json.loads(raw[8 : 8 + n])[name]["data_offsets"][0]
    raw[8 + n + begin + at] ^= 0x01
    f.write_bytes(bytes(raw))


def config_dtype(d: Path) -> Any:
    cfg = json.loads((d / "config.json").read_text())
    return cfg.get("dtype", cfg.get("torch_dtype"))


def dtype_fields(cfg: Any, at: str = "") -> dict[str, Any]:
    """Every dtype field of a config.json's object, a sub-config's too, by its dotted path."""
    if not isinstance(cfg, dict):
        return {}
    out = {f"{at}{k}": v for k, v in cfg.items() if k in ("dtype", "torch_dtype")}
    for k, v in cfg.items():
        out |= dtype_fields(v, f"{at}{k}.")
    return out


def assert_same_tensors(export_dir: Path, ref_dir: Path) -> None:
    got, want = tensors(export_dir), tensors(ref_dir)
    assert sorted(got) == sorted(want), (sorted(set(got) - set(want)), sorted(set(want) - set(got)))
    for name, (dt, shape, data) in want.items():
        assert got[name][:2] == (dt, shape), (name, got[name][:2], (dt, shape))
        assert got[name][2] == data, f"{name}: bytes differ"


def weight_files(d: Path) -> dict[str, bytes]:
    """The files save_pretrained writes the weights to: its safetensors and, when several, their index."""
    names = [p for p in d.iterdir() if p.suffix == ".safetensors" or p.name == layout.INDEX_NAME]
    return {p.name: p.read_bytes() for p in names}


def assert_same_weight_files(export_dir: Path, ref_dir: Path) -> None:
    """The export's weight files are save_pretrained's, by name and byte for byte (one `model.safetensors`
    and no index for a model that fits one file)."""
    got, want = weight_files(export_dir), weight_files(ref_dir)
    assert sorted(got) == sorted(want)
    for name in want:
        if name == layout.INDEX_NAME and got[name] != want[name]:
            diff = difflib.unified_diff(
                want[name].decode().splitlines(), got[name].decode().splitlines(), n=0
            )
            raise AssertionError(f"{name} differs from save_pretrained's:\n" + "\n".join(list(diff)[2:12]))
        assert got[name] == want[name], f"{name}: bytes differ from save_pretrained's"


def load_and_logits(export_dir: Path, dtype: str) -> Any:
    """from_pretrained of the export (nothing missing, unexpected or mismatched) and its logits."""
    import torch
    import transformers as tf

    model, info = tf.AutoModelForCausalLM.from_pretrained(export_dir, output_loading_info=True)
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info[key], (key, info[key])
    assert str(model.dtype) == f"torch.{dtype}", model.dtype  # chosen from the config, as a user gets it
    model.eval()
    with torch.no_grad():
        return model(input_ids=ranks.input_ids()).logits


def check_all(r: Run) -> None:
    """Every claim of the rule, for one run: tensors, config dtype, loading and logits, extras."""
    import torch

    for mode, dtype in (("keep", "float32"), ("bf16", "bfloat16")):
        out, ref = r.exports[mode], r.ref / mode
        assert_same_tensors(out, ref)
        assert_same_weight_files(out, ref)
        assert config_dtype(out) == config_dtype(ref) == dtype
        logits = load_and_logits(out, dtype)
        # The trained model's logits; in bf16, those of its save_pretrained copy loaded the same way (a
        # model cast in memory keeps some buffers in float32, one loaded in bf16 does not).
        want = torch.load(r.ref / "keep.logits.pt") if mode == "keep" else load_and_logits(ref, dtype)
        assert torch.equal(logits, want), mode
        # verify --against re-derives the same plan from the marker and compares every byte
        step = (r.root if mode == "keep" else r.root.parent / "root_bf16") / layout.step_dir_name(ranks.STEP)
        res = run_cli(["verify", step / layout.EXPORT_DIR, "--against", step])
        assert res.returncode == 0, res.stdout + res.stderr
        for name in ("generation_config.json", "tokenizer.json"):
            staged = r.root / layout.step_dir_name(ranks.STEP) / layout.EXTRAS_DIR / name
            assert (out / name).read_bytes() == staged.read_bytes()
