"""`Stager.load` of a committed step whose files were damaged since: a named `LoadError` naming the file,
with the hint to restore the step or load another; never torch's internals, nothing written.

A safetensors header garbled in place (same size) reached DCP's reader, which failed with
`AssertionError: metadata is None; global metadata read failed: ...`, naming no file and no remedy.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from stagerd.contract import layout
from stagerd.errors import LoadError
from tests.training.test_load import _save_with_dcp_optim


def _overwrite(path: Path, at: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[at : at + len(data)] = data
    path.write_bytes(bytes(raw))


def _one(step_dir: Path, pattern: str) -> Path:
    (found,) = step_dir.glob(pattern)
    return found


DAMAGE: dict[str, tuple[str, Callable[[Path], None]]] = {
    "model header length": ("model/*.safetensors", lambda p: _overwrite(p, 0, b"\xff" * 8)),
    "model header json": ("model/*.safetensors", lambda p: _overwrite(p, 8, b"}}garbage")),
    "optim header json": ("optim/*.safetensors", lambda p: _overwrite(p, 8, b"}}garbage")),
    "truncated shard": ("model/*.safetensors", lambda p: os.truncate(p, 20)),
    "missing shard": ("model/*.safetensors", lambda p: p.unlink()),
    "garbled objects": ("optim/*.objects.pt", lambda p: _overwrite(p, 0, b"garbage!" * 4)),
}


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def _refused(root: Path, bad: Path, optim: dict) -> LoadError:
    from stagerd import Stager

    before = _tree(root)
    with Stager(root) as stager, pytest.raises(LoadError) as e:
        stager.load({"w": torch.zeros(3)}, optim)
    assert _tree(root) == before
    text = str(e.value)
    assert "\n" not in text and str(bad) in text, text
    assert "AssertionError" not in text and "metadata is None" not in text, text
    assert "damaged" in e.value.hint and "stagerd restore" in e.value.hint and "--step 1" in e.value.hint
    return e.value


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_a_damaged_step_is_a_named_load_error_naming_the_file(tmp_path, case):
    from stagerd import Stager

    with Stager(tmp_path) as stager:
        saved = {"state": {"w": {"m": torch.randn(3)}}, "param_groups": [{"lr": 0.1}]}
        stager.save({"w": torch.randn(3)}, 1, optimizer_state=saved).result()
    pattern, damage = DAMAGE[case]
    bad = _one(tmp_path / layout.step_dir_name(1), pattern)
    damage(bad)
    _refused(tmp_path, bad, {"state": {"w": {"m": torch.zeros(3)}}, "param_groups": [{"lr": 0.0}]})


@pytest.mark.parametrize("case", ["garbled", "truncated"])
def test_a_damaged_dcp_format_optim_metadata_is_a_named_load_error(tmp_path, case):
    optim = {"state": {"w": {"exp_avg": torch.randn(3)}}, "param_groups": [{"lr": 0.5}]}
    _save_with_dcp_optim(tmp_path, optim)
    bad = tmp_path / layout.step_dir_name(1) / "optim" / ".metadata"
    if case == "garbled":
        _overwrite(bad, 0, b"\x80\x04garbage")
    else:
        os.truncate(bad, bad.stat().st_size // 2)
    _refused(tmp_path, bad, {"state": {"w": {"exp_avg": torch.zeros(3)}}, "param_groups": [{"lr": 0.0}]})
