"""An adopted checkpoint's export cached by an older stagerd build, whose checks differ from this one's, is
never sent as it is to a sink added since: it is exported again from the trainer's checkpoint (so checked
again), or refused by name. One this build made is sent as it is, not exported again.

The older build is this one without the check it lacked: NeMo AutoModel's `moe_rank_scaling` (a tiny
Qwen3-MoE, automodel_moe_peft_run.py) is refused from the `automodel_peft_config.json` beside the adapter,
so with that file set aside the first run publishes the adapter PEFT would fail on, as builds before the
refusal did; its recorded options then lose the key older builds did not write."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from stagerd.contract import layout
from stagerd.contract.adopt.checks import CHECKS_KEY
from stagerd.contract.adopt.peft_names import AUTOMODEL_PEFT_CONFIG
from stagerd.contract.layout import ADAPTER_WEIGHTS_NAME
from tests.adopt.helpers import published, tree_digest, watch_once
from tests.adopt.trainers import automodel_moe_peft_run as moe
from tests.adopt.trainers import tiny
from tests.daemon_helpers import free_port
from tests.gloo import launch

pytestmark = pytest.mark.slow
NAME = f"epoch_0_step_{tiny.STEPS}"


@pytest.fixture(scope="module")
def train(tmp_path_factory) -> Callable[[Path, bool], Path]:
    """`train(root, moe_rank_scaling)`: a copy of its own at `root` of AutoModel's output, trained once per
    `moe_rank_scaling` for the module (each watch writes its journal and adopted export under `root`)."""
    runs: dict[bool, Path] = {}

    def copy(root: Path, moe_rank_scaling: bool) -> Path:
        if moe_rank_scaling not in runs:
            run = tmp_path_factory.mktemp("automodel") / "train"
            launch(moe.train, str(run), "", free_port(), True, moe_rank_scaling, world=1)
            runs[moe_rank_scaling] = run
        shutil.copytree(runs[moe_rank_scaling], root, symlinks=True)
        return root / NAME

    return copy


def work_dir(root: Path) -> Path:
    return root / layout.STATE_DIR / "adopted" / NAME


def as_an_older_build_left_it(root: Path) -> None:
    """The export's recorded options without the key builds before it did not write."""
    options = work_dir(root) / layout.EXPORT_OPTIONS_NAME
    recorded = json.loads(options.read_text())
    recorded.pop(CHECKS_KEY, None)
    options.write_text(json.dumps(recorded))


def weights(root: Path) -> tuple[int, int]:
    """The exported adapter file's identity: its inode and mtime (a rebuilt file may reuse the inode of
    the one it replaced)."""
    st = (work_dir(root) / layout.EXPORT_DIR / ADAPTER_WEIGHTS_NAME).stat()
    return st.st_ino, st.st_mtime_ns


def test_an_older_builds_export_is_checked_again_and_refused_before_a_new_sink_gets_it(train, tmp_path):
    ckpt = train(tmp_path / "train", moe_rank_scaling=True)
    aside = tmp_path / AUTOMODEL_PEFT_CONFIG
    os.rename(ckpt / "model" / AUTOMODEL_PEFT_CONFIG, aside)
    res = watch_once(tmp_path / "train", tmp_path / "a")
    assert "1 step(s) published, 0 not" in res.stdout + res.stderr, res.stdout + res.stderr
    os.rename(aside, ckpt / "model" / AUTOMODEL_PEFT_CONFIG)
    as_an_older_build_left_it(tmp_path / "train")
    before = tree_digest(tmp_path / "train")

    res = watch_once(tmp_path / "train", tmp_path / "a", "--sink", f"file://{tmp_path / 'b'}")
    out = res.stdout + res.stderr
    assert "AdoptError: export/ was made by a stagerd build whose checks differ" not in out, out
    assert "AdoptError: AutoModel's moe_rank_scaling trained 'base_model.model.model.layers.0." in out, out
    assert not published(tmp_path / "b", tiny.STEPS).exists()
    assert tree_digest(tmp_path / "train") == before


def test_an_older_builds_export_is_rebuilt_for_a_new_sink_and_this_builds_is_sent_as_it_is(train, tmp_path):
    train(tmp_path / "train", moe_rank_scaling=False)
    res = watch_once(tmp_path / "train", tmp_path / "a")
    assert "1 step(s) published, 0 not" in res.stdout + res.stderr, res.stdout + res.stderr
    made = weights(tmp_path / "train")

    res = watch_once(tmp_path / "train", tmp_path / "a", "--sink", f"file://{tmp_path / 'b'}")
    assert "1 step(s) published, 0 not" in res.stdout + res.stderr, res.stdout + res.stderr
    assert weights(tmp_path / "train") == made  # this build's export: not made again
    assert "exporting again" not in res.stdout + res.stderr

    as_an_older_build_left_it(tmp_path / "train")
    res = watch_once(tmp_path / "train", tmp_path / "a", "--sink", f"file://{tmp_path / 'c'}")
    out = res.stdout + res.stderr
    assert "1 step(s) published, 0 not" in out, out
    assert "made by a stagerd build whose checks differ; exporting again" in out, out
    assert weights(tmp_path / "train") != made
    recorded = json.loads((work_dir(tmp_path / "train") / layout.EXPORT_OPTIONS_NAME).read_text())
    assert CHECKS_KEY in recorded
    sent = [published(tmp_path / s, tiny.STEPS) / ADAPTER_WEIGHTS_NAME for s in "abc"]
    assert len({p.read_bytes() for p in sent}) == 1  # the rebuild gives the bytes the first sinks hold


def test_an_older_builds_export_whose_checkpoint_is_gone_is_sent_nowhere_new(train, tmp_path):
    ckpt = train(tmp_path / "train", moe_rank_scaling=False)
    res = watch_once(tmp_path / "train", tmp_path / "a")
    assert "1 step(s) published, 0 not" in res.stdout + res.stderr, res.stdout + res.stderr
    as_an_older_build_left_it(tmp_path / "train")
    shutil.rmtree(ckpt)  # the trainer's own rotation

    res = watch_once(tmp_path / "train", tmp_path / "a", "--sink", f"file://{tmp_path / 'b'}")
    out = res.stdout + res.stderr
    assert "AdoptError: export/ was made by a stagerd build whose checks differ, and the trainer" in out, out
    assert out.count('"state": "quarantined"') == 1, out  # once: never tried again
    assert not published(tmp_path / "b", tiny.STEPS).exists()
