"""`stagerd watch --adopt` on what Lightning 2.6's `FSDPStrategy(state_dict_type="sharded")` writes:
`epoch=E-step=S.ckpt/`, a DCP directory holding the module's state dict under `model.` (not
`ModelParallelStrategy`'s `state_dict.`) and the optimizer under `optimizer_0.`, then rank 0's `meta.pt`.

Lightning's FSDP needs a GPU (torch's FSDP1 refuses a CPU-only host), so the run here trains on one CPU
and hands the Trainer's own checkpoint dict to the strategy's own `save_checkpoint`: what it writes is
the library's code, the tensor names those of a module FSDP wraps (it keeps the module's own names)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.adopt.helpers import published, tree_digest, watch_once
from tests.fidelity.harness import assert_same_tensors

pytestmark = pytest.mark.slow
NAME = "epoch=0-step={}.ckpt"


def _fit_and_save(tmp: Path) -> Any:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.strategies import FSDPStrategy

    from tests.integrations.lightning_ranks import TinyLM

    ids = torch.randint(3, 96, (4, 12), generator=torch.Generator().manual_seed(3))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2)
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    module = TinyLM(0)
    trainer.fit(module, data)
    checkpoint = trainer._checkpoint_connector.dump_checkpoint()
    FSDPStrategy(state_dict_type="sharded").save_checkpoint(checkpoint, tmp / "checkpoints" / NAME.format(1))
    module.model.config.save_pretrained(tmp / "checkpoints")  # kept beside the checkpoints by the user
    module.model.save_pretrained(tmp / "ref")
    return module


def test_an_fsdp_strategys_sharded_checkpoint_is_published_as_save_pretrained_writes_it(tmp_path):
    import transformers as tf

    _fit_and_save(tmp_path)
    watched = tmp_path / "checkpoints"
    ckpt = watched / NAME.format(1)
    assert sorted(p.name for p in ckpt.iterdir()) == [".metadata", "__0_0.distcp", "meta.pt"]
    cut = watched / NAME.format(2)  # the save killed before rank 0's meta.pt
    shutil.copytree(ckpt, cut)
    (cut / "meta.pt").unlink()
    before = tree_digest(watched)

    res = watch_once(watched, tmp_path / "sink")
    assert "1 step(s) published, 0 not" in res.stdout + res.stderr, res.stdout + res.stderr
    assert_same_tensors(published(tmp_path / "sink", 1), tmp_path / "ref")  # the tied head left out
    assert not published(tmp_path / "sink", 2).exists()
    assert tree_digest(watched) == before
    _, info = tf.AutoModelForCausalLM.from_pretrained(
        published(tmp_path / "sink", 1), output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    again = tmp_path / "again"  # the preset by name, in a folder of its own (no export to reuse)
    shutil.copytree(watched, again, ignore=shutil.ignore_patterns(".stagerd"))
    named = watch_once(again, tmp_path / "named", "--adopt", "lightning")
    assert "1 step(s) published, 0 not" in named.stdout + named.stderr, named.stdout + named.stderr
    assert_same_tensors(published(tmp_path / "named", 1), tmp_path / "ref")
