"""One `stagerd watch --adopt --once` over a trainer's real output, and every claim about its result.

`adopt(kind, tmp)` trains (`produce`), puts beside the finished checkpoint a copy of it cut where the
trainer's own completion signal is not yet written (as if the trainer were killed just before it),
snapshots the trainer's folder, then runs the daemon once with a file:// sink, exactly as a user would.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stagerd.contract import layout
from tests.adopt.helpers import published, watch_once
from tests.adopt.trainers import tiny
from tests.adopt.trainers.produce import Produced, produce, snapshot
from tests.fidelity.harness import assert_same_tensors, config_dtype

UNFINISHED_STEP = 2 * tiny.STEPS


@dataclass(frozen=True)
class Adopted:
    run: Produced
    watched: Path  # the folder `watch --adopt` was pointed at
    unfinished: Path  # the checkpoint cut before its completion signal
    before: dict[str, str]  # snapshot(watched) before the daemon ran
    result: subprocess.CompletedProcess[str]
    sink: Path

    def published(self, step: int = tiny.STEPS) -> Path:
        return published(self.sink, step)


def _cut_before_completion(kind: str, ckpt: Path) -> Path:
    """A copy of `ckpt` as the trainer leaves it when killed just before it marks the save finished."""
    name = ckpt.name.replace(str(tiny.STEPS), str(UNFINISHED_STEP))
    cut = ckpt.with_name(name)
    shutil.copytree(ckpt, cut, symlinks=True)
    if kind == "hf_trainer":  # trainer_state.json comes last, after the model and optimizer
        (cut / "trainer_state.json").unlink()
    elif kind == "lightning":  # rank 0 writes meta.pt after the DCP save's .metadata
        (cut / "meta.pt").unlink()
    else:  # AutoModel removes `.incomplete` last, after every file of the save
        (cut / ".incomplete").touch()
    return cut


def adopt(kind: str, tmp: Path, *flags: str) -> Adopted:
    run = produce(kind, tmp)
    watched = run.checkpoint.parent
    unfinished = _cut_before_completion(kind, run.checkpoint)
    before = snapshot(watched)
    sink = tmp / "sink"
    extras = ["--extras", str(run.extras)] if run.extras else []
    return Adopted(run, watched, unfinished, before, watch_once(watched, sink, *extras, *flags), sink)


def check_published(a: Adopted, preset: str) -> None:
    """Published once, by the preset `auto` should pick, equal to save_pretrained tensor for tensor."""
    assert a.result.returncode == 0, a.result.stdout + a.result.stderr
    assert "1 step(s) published, 0 not" in a.result.stdout + a.result.stderr
    export = a.watched / ".stagerd" / "adopted" / a.run.checkpoint.name
    assert json.loads((export / "export.options.json").read_text())["preset"] == preset
    out = a.published()
    assert (out / layout.MANIFEST_NAME).is_file() and (a.sink / "latest").is_file()
    assert_same_tensors(out, a.run.ref)  # names, dtypes, shapes and bytes
    assert config_dtype(out) == config_dtype(a.run.ref)


def check_loads(a: Adopted, dtype: str) -> None:
    """from_pretrained of the export: nothing missing, unexpected or mismatched; the dtype its config says."""
    import transformers as tf

    model: Any
    model, info = tf.AutoModelForCausalLM.from_pretrained(a.published(), output_loading_info=True)
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info[key], (key, info[key])
    assert str(model.dtype) == f"torch.{dtype}", model.dtype


def check_unfinished_left_alone(a: Adopted) -> None:
    assert not a.published(UNFINISHED_STEP).exists()
    assert not (a.watched / ".stagerd" / "adopted" / a.unfinished.name).exists()


def check_untouched(a: Adopted) -> None:
    """Every file and link the trainer wrote is as it was, byte for byte (links too, unlike
    helpers.tree_digest: AutoModel's `LATEST`); the daemon added only its own `.stagerd/` folder
    (journal and exports), none of it inside a checkpoint."""
    after = snapshot(a.watched)
    changed = {k for k, v in a.before.items() if after.get(k) != v}
    assert not changed, sorted(changed)
    added = set(after) - set(a.before)
    assert all(k == ".stagerd" or k.startswith(".stagerd/") for k in added), sorted(added)
