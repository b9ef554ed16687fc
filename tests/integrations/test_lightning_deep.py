"""A Lightning checkpoint path holding JSON nested past the interpreter's stack (64 KiB of `[`, under the
pointer file's size cap): before, `load_checkpoint` and `fit(ckpt_path=...)` died of a bare RecursionError
in the pointer's parse. Now a LoadError names the file, and nothing is loaded. The trainer-state tree
(`state_tree`, Lightning's and the HF Trainer's) names nesting too deep to save or to rebuild the same way."""

from __future__ import annotations

import json
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from stagerd.contract import layout
from stagerd.errors import LoadError, SaveInputError
from stagerd.integrations import state_tree
from stagerd.integrations.ckpt_pointer import MAX_POINTER_BYTES, POINTER
from stagerd.integrations.lightning import StagerdCheckpointIO
from tests.fidelity import models

DEEP = "[" * 60_000 + "]" * 60_000  # a blob: no size cap before the parse
OPEN = "[" * (MAX_POINTER_BYTES - 100)  # within the pointer size cap


class TinyLM(pl.LightningModule):
    def __init__(self) -> None:
        import transformers as tf

        super().__init__()
        self.model = tf.AutoModelForCausalLM.from_config(models.config("llama"))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


@pytest.mark.parametrize(
    "text",
    [OPEN, f'{{"format": "{POINTER}", "step": {"[" * 30_000 + "]" * 30_000}}}'],
    ids=["unclosed", "a pointer's field"],
)
def test_a_pointer_nested_too_deep_is_a_load_error(tmp_path, text):
    ckpt = tmp_path / "last.ckpt"
    ckpt.write_text(text)
    assert ckpt.stat().st_size <= MAX_POINTER_BYTES
    io = StagerdCheckpointIO(tmp_path / "root")
    with pytest.raises(LoadError, match="nested too deep") as e:
        io.load_checkpoint(ckpt)
    assert e.value.path == str(ckpt) and "nothing was loaded" in e.value.hint
    with pytest.raises(LoadError, match="nested too deep"):
        io.remove_checkpoint(ckpt)
    assert ckpt.read_text() == text  # not ours to delete


def test_fit_from_a_pointer_nested_too_deep_loads_nothing(tmp_path):
    module = TinyLM()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    ckpt = tmp_path / "last.ckpt"
    ckpt.write_text(OPEN)
    ids = torch.randint(0, models.VOCAB, (4, 12), generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path,
        plugins=[StagerdCheckpointIO(tmp_path / "root", model=module)],
    )  # fmt: skip
    with pytest.raises(LoadError, match="nested too deep"):
        trainer.fit(module, data, ckpt_path=ckpt)
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())
    assert layout.committed_steps(tmp_path / "root") == []


def _nested(depth: int) -> list[Any]:
    out: list[Any] = []
    for _ in range(depth):
        out = [out]
    return out


def test_the_state_tree_names_nesting_too_deep():
    with pytest.raises(SaveInputError, match="nested too deep to save"):
        state_tree.split({"callbacks": _nested(100_000)}, "lightning")
    blob = torch.frombuffer(bytearray(DEEP.encode()), dtype=torch.uint8)
    with pytest.raises(LoadError, match="nested too deep"):
        state_tree.from_blob(blob, "the saved Lightning state")
    skeleton = json.loads("[" * 900 + "]" * 900)  # parses, but two frames a level rebuild it
    with pytest.raises(LoadError, match="nested too deep"):
        state_tree.join(skeleton, lambda key: torch.zeros(1))
    with pytest.raises(LoadError, match="nested too deep"):
        state_tree.tensor_specs(_nested(100_000))
