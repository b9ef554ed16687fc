"""`stagerd watch --adopt` on what a real Lightning 2.6 `ModelParallelStrategy` (FSDP2) run writes on
2 gloo CPU ranks: `checkpoints/epoch=0-step=2.ckpt/`, one DCP directory holding the module's model under
`state_dict.model.` and its optimizer, finished by rank 0's `meta.pt`. The model ties its embeddings:
the checkpoint has `lm_head.weight` too, `save_pretrained` does not. config.json is kept beside the
checkpoints, in the folder the daemon watches."""

from __future__ import annotations

import pytest

from tests.adopt.trainers import checks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def adopted(tmp_path_factory) -> checks.Adopted:
    return checks.adopt("lightning", tmp_path_factory.mktemp("lightning"))


def test_the_strategy_writes_one_dcp_directory_per_checkpoint(adopted):
    ckpt = adopted.run.checkpoint
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]


def test_the_export_is_what_save_pretrained_writes_and_loads(adopted):
    checks.check_published(adopted, "lightning")
    checks.check_loads(adopted, "float32")


def test_a_checkpoint_without_meta_pt_is_not_exported(adopted):
    checks.check_unfinished_left_alone(adopted)


def test_the_trainers_checkpoints_are_untouched(adopted):
    checks.check_untouched(adopted)


def test_a_single_file_checkpoint_is_named_as_never_exported(tmp_path):
    """Lightning's DDP and single-device strategies save `epoch=E-step=S.ckpt` as one torch.save file,
    which stagerd never unpickles. Before, `watch --adopt` passed it over in silence; now it says why,
    once, and publishes nothing."""
    import lightning.pytorch as pl
    import torch

    from tests.adopt.helpers import watch_once
    from tests.integrations.lightning_ranks import TinyLM

    ids = torch.randint(3, 96, (4, 12), generator=torch.Generator().manual_seed(3))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2)
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", devices=1, default_root_dir=tmp_path / "run",
                         logger=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(TinyLM(0), data)
    watched = tmp_path / "run" / "checkpoints"
    assert (watched / "epoch=0-step=1.ckpt").is_file()
    res = watch_once(watched, tmp_path / "sink")
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "0 step(s) published" in out, out
    assert out.count("epoch=0-step=1.ckpt is one file") == 1, out
