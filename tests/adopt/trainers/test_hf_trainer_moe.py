"""`stagerd watch --adopt` on a real HF `Trainer` checkpoint of a MoE model (a tiny Mixtral, FSDP2 with
`SHARDED_STATE_DICT` on 2 gloo CPU ranks): the checkpoint holds transformers' live, fused names, and the
export, given the model's config.json, is what `save_pretrained` writes, byte for byte. Without
transformers in the daemon, or with a config of another model, the checkpoint's names are kept."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from stagerd.contract.adopt.dcp_metadata import read_dcp_metadata
from stagerd.daemon.hf_names import KEPT
from tests.adopt.helpers import published, watch_once
from tests.adopt.trainers import tiny
from tests.adopt.trainers.hf_trainer_moe import train
from tests.cli_helpers import run_cli
from tests.daemon_helpers import fast_flags, free_port
from tests.fidelity.harness import assert_same_tensors, assert_same_weight_files, tensors
from tests.gloo import launch

pytestmark = pytest.mark.slow

CKPT = f"checkpoint-{tiny.STEPS}"
FUSED = "model.layers.0.mlp.experts.gate_up_proj"  # the live name; save_pretrained splits it per expert
SPLIT = "model.layers.0.block_sparse_moe.experts.0.w1.weight"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """tmp/train/checkpoint-2 (the Trainer's), tmp/ref (save_pretrained), tmp/extras (config.json)."""
    import transformers as tf

    tmp = tmp_path_factory.mktemp("hf_trainer_moe")
    launch(train, str(tmp / "train"), str(tmp / "ref"), free_port(), world=2, deadline_s=240)
    tiny.write_extras(tf.AutoConfig.from_pretrained(tmp / "ref"), tmp / "extras")
    return tmp


@pytest.fixture(scope="module")
def exported(run) -> tuple[Any, Path]:
    """`watch --once` of the Trainer's checkpoint, given the model's config.json: (the watch, its sink)."""
    sink = run / "sink"
    return watch_once(run / "train", sink, "--extras", str(run / "extras")), sink


def _watched(run: Path, name: str) -> Path:
    """A ROOT of its own holding a copy of the Trainer's checkpoint: each watch keeps its own journal."""
    root = run / name
    shutil.copytree(run / "train" / CKPT, root / CKPT)
    return root


def test_the_trainers_checkpoint_holds_the_fused_live_names(run):
    keys = read_dcp_metadata(run / "train" / CKPT / "pytorch_model_fsdp_0" / ".metadata").tensors
    assert f"model.{FUSED}" in keys
    assert SPLIT in tensors(run / "ref") and FUSED not in tensors(run / "ref")


def test_the_export_is_what_save_pretrained_writes_and_loads(run, exported):
    import torch
    import transformers as tf

    res, sink = exported
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "1 step(s) published, 0 not" in out, out
    assert KEPT not in out, out
    export = published(sink, tiny.STEPS)
    assert_same_tensors(export, run / "ref")  # names, dtypes, shapes and bytes
    assert_same_weight_files(export, run / "ref")  # and its file, header and order included
    model, info = tf.AutoModelForCausalLM.from_pretrained(export, output_loading_info=True)
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info[key], (key, info[key])
    ref = tf.AutoModelForCausalLM.from_pretrained(run / "ref")
    ids = tiny.token_rows(2, seed=7)
    with torch.no_grad():
        assert torch.equal(model.eval()(input_ids=ids).logits, ref.eval()(input_ids=ids).logits)


def test_a_daemon_without_transformers_keeps_the_checkpoints_names(run, tmp_path):
    hidden = tmp_path / "hidden" / "transformers"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('hidden from this daemon by the test')\n")
    root = _watched(run, "without_transformers")
    # `python -m stagerd.cli` imports from its working directory first: there, transformers fails to import
    res = run_cli(
        ["watch", root, "--adopt", "--sink", f"file://{tmp_path / 'sink'}", "--once", *fast_flags(),
         "--extras", run / "extras"],
        cwd=hidden.parent,
        timeout=180,
    )  # fmt: skip
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "1 step(s) published, 0 not" in out, out
    names = tensors(published(tmp_path / "sink", tiny.STEPS))
    assert FUSED in names and SPLIT not in names


def test_a_config_of_another_model_keeps_the_names_and_says_so_once(run, tmp_path):
    tiny.write_extras(tiny.config(), tmp_path / "llama")  # a Llama's config beside a Mixtral's weights
    root = _watched(run, "other_config")
    shutil.copytree(root / CKPT, root / f"checkpoint-{2 * tiny.STEPS}")  # two checkpoints, one warning
    res = watch_once(root, tmp_path / "sink", "--extras", str(tmp_path / "llama"))
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "2 step(s) published, 0 not" in out, out
    assert out.count(KEPT) == 1 and "LlamaForCausalLM" in out, out
    for step in (tiny.STEPS, 2 * tiny.STEPS):
        names = tensors(published(tmp_path / "sink", step))
        assert FUSED in names and SPLIT not in names


def test_verify_and_consolidate_take_the_names_watch_exports(run, exported, tmp_path):
    ckpt, extras = run / "train" / CKPT, str(run / "extras")
    res, sink = exported
    assert res.returncode == 0, res.stdout + res.stderr
    res = run_cli(["verify", published(sink, tiny.STEPS), "--against", ckpt, "--adopt", "--extras", extras])
    assert res.returncode == 0 and "every byte equal to" in res.stdout, res.stdout + res.stderr
    res = run_cli(["consolidate", ckpt, tmp_path / "hf", "--adopt", "--extras", extras])
    assert res.returncode == 0, res.stdout + res.stderr
    assert_same_weight_files(tmp_path / "hf", run / "ref")
