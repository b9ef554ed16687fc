"""`watch --adopt` on a ROOT whose checkpoints are named in no way it knows (`save_at_10/`): each such
directory that holds a DCP checkpoint is named in a warning that points at `--adopt-step`, where the run
said only '0 step(s) published'; a folder of other things (`logs/`) stays a quiet note; with the
`--adopt-step` the warning gives, the same checkpoints are exported and published (real `dcp.save`, the
real CLI)."""

from __future__ import annotations

import json

import torch
import torch.distributed.checkpoint as dcp

from stagerd.contract import layout
from tests.cli_helpers import run_cli


def _logged(stderr: str) -> list[dict]:
    return [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]


def test_a_checkpoint_whose_name_gives_no_step_is_named_with_the_flag_that_reads_it(tmp_path):
    root, sink = tmp_path / "root", tmp_path / "sink"
    for step in (10, 20):
        state = {"model": {"w": torch.full((4,), float(step))}}
        dcp.save(state, checkpoint_id=str(root / f"save_at_{step}"), no_dist=True)
    (root / "logs").mkdir()
    (root / "logs" / "events.txt").write_text("loss 1.0\n")

    proc = run_cli(["watch", root, "--adopt", "dcp", "--sink", sink, "--once"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "0 step(s) published" in proc.stdout
    logged = _logged(proc.stderr)
    warned = {r["ignored"]: r["msg"] for r in logged if r["level"] == "warning" and "ignored" in r}
    assert sorted(warned) == ["save_at_10", "save_at_20"], proc.stderr[-3000:]
    assert all("--adopt-step REGEX" in m for m in warned.values())
    noted = [r for r in logged if r.get("ignored") == "logs"]
    assert [r["level"] for r in noted] == ["info"]

    flag = ["--adopt-step", r"save_at_(?P<step>\d+)"]
    proc = run_cli(["watch", root, "--adopt", "dcp", *flag, "--sink", sink, "--once"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 step(s) published" in proc.stdout
    assert any((sink / layout.step_dir_name(20)).glob("*.safetensors"))


def test_a_run_folder_given_for_its_checkpoints_folder_says_to_pass_that_folder(tmp_path):
    # torchtitan's layout: RUN/checkpoint/step-N/.metadata, RUN given as ROOT
    run, sink = tmp_path / "run", tmp_path / "sink"
    dcp.save({"model": {"w": torch.ones(4)}}, checkpoint_id=str(run / "checkpoint" / "step-1"), no_dist=True)
    proc = run_cli(["watch", run, "--adopt", "dcp", "--sink", sink, "--once"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    warned = [r["msg"] for r in _logged(proc.stderr) if r.get("ignored") == "checkpoint"]
    assert len(warned) == 1 and "holds checkpoints (step-1)" in warned[0], proc.stderr[-3000:]
    assert "--adopt-step" not in warned[0]
    assert f"stagerd watch {run / 'checkpoint'} --adopt" in proc.stdout, proc.stdout
