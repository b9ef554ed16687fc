"""`watch --adopt` over checkpoints with no config.json anywhere it looks (the HF Trainer writes none
beside a SHARDED_STATE_DICT checkpoint): the exports are made as before, and the run says once, naming
`--extras DIR`, that they keep the checkpoint's names and that no loader reads them, where it said
nothing; with config.json in ROOT it says nothing (real `dcp.save` of a real Llama, the real CLI)."""

from __future__ import annotations

import json

import torch.distributed.checkpoint as dcp

from stagerd.contract import layout
from tests.cli_helpers import run_cli
from tests.training.tiny_llama import tiny_llama


def _saves(root, steps):
    model = tiny_llama(tied=False)
    for step in steps:
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(root / f"step-{step}"), no_dist=True)
    return model


def _warnings(stderr: str) -> list[str]:
    logged = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    return [r["msg"] for r in logged if r["level"] == "warning"]


def test_exports_without_a_config_are_named_once_with_the_flag_that_gives_one(tmp_path):
    root, sink = tmp_path / "root", tmp_path / "sink"
    _saves(root, (1, 2))
    proc = run_cli(["watch", root, "--adopt", "dcp", "--sink", sink, "--once"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 step(s) published" in proc.stdout
    told = [m for m in _warnings(proc.stderr) if "no config.json" in m]
    assert len(told) == 1, proc.stderr[-3000:]
    assert "--extras DIR" in told[0] and "from_pretrained cannot load it" in told[0]
    assert not (sink / layout.step_dir_name(2) / "config.json").exists()


def test_a_config_in_root_is_found_and_nothing_is_said(tmp_path):
    root, sink = tmp_path / "root", tmp_path / "sink"
    model = _saves(root, (1,))
    model.config.save_pretrained(root)
    proc = run_cli(["watch", root, "--adopt", "dcp", "--sink", sink, "--once"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not [m for m in _warnings(proc.stderr) if "no config.json" in m], proc.stderr[-3000:]
    assert (sink / layout.step_dir_name(1) / "config.json").exists()
