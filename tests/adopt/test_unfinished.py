"""`watch --adopt --once`, run after training, names the checkpoints it left alone as unfinished (a trainer
killed mid-save) once in its summary, each with its preset's rule for "finished": before, it said nothing
of them, and a half-written save was passed over in silence, run after run. Not a failure: exit 0."""

from __future__ import annotations

import json
import shutil

from stagerd.contract.adopt.presets import LAYOUTS
from stagerd.daemon.unfinished import Unfinished, finished_rule, newest_of, unfinished_text
from tests.adopt import ranks
from tests.adopt.helpers import published, tree_digest, watch_once
from tests.cli_helpers import run_cli

LEFT = "checkpoint(s) not finished, left alone"


def test_once_names_each_unfinished_checkpoint_with_its_rule_and_exits_0(tmp_path):
    root, sink = tmp_path / "root", tmp_path / "sink"
    model = root / "step-1"
    ranks.write(str(model))
    shutil.copytree(model, root / "step-2")
    (root / "step-2" / ".metadata").unlink()  # torchtitan / dcp.save killed before its coordinator wrote it
    shutil.copytree(model, root / "checkpoint-3" / "pytorch_model_fsdp_0")  # no trainer_state.json yet
    (root / "epoch_0_step_4" / "model").mkdir(parents=True)
    (root / "epoch_0_step_4" / ".incomplete").touch()  # AutoModel removes it last
    (root / "logs").mkdir()  # its name gives no step: not a checkpoint
    before = tree_digest(root)

    res = watch_once(root, sink)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "1 step(s) published, 0 not" in res.stdout, out
    assert published(sink, 1).is_dir() and not any(published(sink, s).exists() for s in (2, 3, 4))
    line = next(ln for ln in res.stdout.splitlines() if LEFT in ln)
    assert f"3 {LEFT}" in line, line
    assert (
        "step-2 (no --adopt preset recognises it yet: a DCP checkpoint is recognised once its .metadata"
        in line
    )
    assert (
        "checkpoint-3 (hf-trainer: finished once pytorch_model_fsdp_0/.metadata and a whole "
        "trainer_state.json exist)"
    ) in line
    assert "epoch_0_step_4 (automodel: finished once model/ holds its safetensors shards, and its " in line
    assert "Their tensors were not read and nothing of them was published; the next run takes each up" in line
    assert line.endswith("once it is finished"), line
    assert "logs" not in line and ".stagerd" not in line
    assert res.stderr.count(LEFT) == 1  # said once, in the summary
    assert "--once: 1 step(s) published" in res.stderr and "all 1 step(s)" not in res.stderr
    assert tree_digest(root) == before

    # `stagerd status` names them too, as the daemon's last scan left them (before: nothing, so a running
    # daemon never named a save a killed trainer left half-written)
    said = _status_line(root)
    assert said.startswith(f"at the daemon's last scan, 3 {LEFT}: step-2 (no --adopt preset"), said
    assert "the daemon takes each up once it is finished" in said, said
    doc = json.loads(run_cli(["status", root, "--json"]).stdout)["unfinished"]
    assert doc["count"] == 3 and [n for _, n, _ in doc["newest"]] == [
        "step-2",
        "checkpoint-3",
        "epoch_0_step_4",
    ]
    shutil.copy(model / ".metadata", root / "step-2" / ".metadata")  # finished after all
    assert watch_once(root, sink).returncode == 0 and published(sink, 2).is_dir()
    said = _status_line(root)
    assert f"2 {LEFT}: checkpoint-3" in said and "step-2" not in said, said


def _status_line(root):
    res = run_cli(["status", root], env={"COLUMNS": "1000"})
    assert res.returncode == 0, res.stdout + res.stderr
    return next(ln for ln in res.stdout.splitlines() if LEFT in ln)


def test_the_summary_names_the_newest_few_and_counts_the_rest():
    rule = finished_rule(LAYOUTS["torchtitan"][0])
    assert rule == "torchtitan: finished once .metadata exists"
    found = [Unfinished(s, f"step-{s}", rule) for s in range(12, 0, -1)]
    assert [u.step for u in newest_of(found, 10)] == list(range(3, 13))
    shown = newest_of(found, 2)
    text = unfinished_text(12, shown, adopt=True)
    assert text.startswith(f"12 {LEFT}, the newest 2: step-11, step-12 ({rule}). Their tensors"), text
    assert "once it is finished" in text
    lightning = finished_rule(LAYOUTS["lightning"][0])
    assert lightning == "lightning: finished once .metadata and a whole meta.pt exist"
    assert finished_rule(LAYOUTS["hf"][0]) == (
        "hf: finished once its safetensors files are whole (the index parses)"
    )
