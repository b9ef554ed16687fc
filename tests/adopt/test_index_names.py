"""An adopted HF-files checkpoint (the HF Trainer's `checkpoint-N`) whose index names a file no directory
can hold (a NUL, a control character, `..`, a path, an absolute path, no name): before, the daemon took the
checkpoint for one still being written and waited on it for good, neither publishing nor naming it (a NUL
name reached `open` as a bare ValueError). Now it is quarantined by name; an index still being written
(JSON that does not parse yet) is still waited on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stagerd.contract.adopt.presets import get_preset
from stagerd.engine.adopt.detect import choose_preset
from stagerd.engine.adopt.finished import finished, save_identity
from tests.adopt.helpers import published, tree_digest, watch_once
from tests.cli_helpers import run_cli

GOOD = "model-00002-of-00002.safetensors"


def _checkpoint(ck: Path, second: str) -> None:
    import torch
    from safetensors.torch import save_file

    ck.mkdir(parents=True)
    save_file({"a": torch.ones(2)}, ck / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file({"b": torch.ones(2)}, ck / GOOD, metadata={"format": "pt"})
    wm = {"a": "model-00001-of-00002.safetensors", "b": second}
    (ck / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    (ck / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (ck / "trainer_state.json").write_text(json.dumps({"global_step": 5}))


@pytest.mark.parametrize(
    "name",
    [GOOD.replace("-of", "\0-of"), "..", "../" + GOOD, "/etc/hostname", "", "a\x1bb", "sub/" + GOOD, "\n"],
    ids=["nul", "dotdot", "up", "absolute", "empty", "escape", "path", "newline"],
)
def test_an_index_naming_a_hostile_file_is_quarantined_by_name(tmp_path, name):
    run = tmp_path / "run"
    _checkpoint(run / "checkpoint-5", name)
    before = tree_digest(run)
    res = watch_once(run, tmp_path / "out")
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "0 step(s) published, 1 not" in out, out
    status = run_cli(["status", run]).stdout
    row = next(ln for ln in status.splitlines() if ln.strip().startswith("5 "))
    assert "quarantined" in row, status
    error = "ReferenceIndexError" if name == "" else "ShardError"  # no name: the weight_map's own check
    assert error in status and "model.safetensors.index.json" in status, status
    assert not published(tmp_path / "out", 5).exists()
    assert tree_digest(run) == before


def test_an_index_still_being_written_is_waited_on_and_a_good_one_published(tmp_path):
    run = tmp_path / "run"
    ck = run / "checkpoint-5"
    _checkpoint(ck, GOOD)
    index = ck / "model.safetensors.index.json"
    whole = index.read_bytes()
    preset = choose_preset(ck, get_preset("hf-trainer").name)
    index.write_bytes(whole[:-20])
    assert finished(ck, preset) is None
    index.write_bytes(whole)
    assert finished(ck, preset) is not None and save_identity(ck, preset).startswith("files:")
    res = watch_once(run, tmp_path / "out")
    assert res.returncode == 0 and "1 step(s) published, 0 not" in res.stdout, res.stdout + res.stderr


def test_consolidate_refuses_a_nul_in_an_index_name_by_name(tmp_path):
    """Before: `consolidate --adopt` died of a bare ValueError (embedded null byte)."""
    ck = tmp_path / "checkpoint-5"
    _checkpoint(ck, GOOD.replace("-of", "\0-of"))
    res = run_cli(["consolidate", ck, tmp_path / "out", "--adopt", "hf-trainer"])
    assert res.returncode == 2 and "ShardError" in res.stderr and "not a plain name" in res.stderr, res.stderr
    assert not (tmp_path / "out").exists()
