"""Extras names a save would have failed to write, or that its export would have dropped, are refused by
`save()` before anything is written; the extras the export takes (config, tokenizer) still reach it.

Before: a 200-byte name failed after `save()` returned, in the writer's temp name, with a hint to free
disk space; `model.safetensors`, a shard's name, the index, the reference index's file names and the
manifest were committed and then left out of the export (the export's own files won), unsaid.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from stagerd.contract import layout
from stagerd.errors import SaveInputError
from stagerd.training import save_inputs
from tests.training.test_unusual_inputs import _export

TAKEN = {
    "config.json": {"model_type": "llama", "torch_dtype": "float32"},
    "generation_config.json": {"max_new_tokens": 8},
    "tokenizer.json": {"version": "1.0"},
    "tokenizer_config.json": {"model_max_length": 16},
    "special_tokens_map.json": {},
    "adapter_config.json": {"r": 4},
    "chat_template.jinja": b"{{ messages }}",
    "tokenizer/vocab.txt": b"a\nb\n",
    "n" * 128: b"the longest part allowed",
}


@pytest.mark.parametrize(
    "name",
    [
        "x" * 129,
        "dir/" + "é" * 65,  # 130 bytes in one part
        "/".join(["d" * 100] * 11),  # each part short, 1110 bytes in all
    ],
)
def test_an_extras_name_too_long_to_write_is_refused_at_save(tmp_path, name):
    from stagerd import Stager

    with Stager(tmp_path) as stager, pytest.raises(SaveInputError, match="too long") as e:
        stager.save({"w": torch.ones(2)}, 1, extras={name: b"x"})
    assert "128 bytes per part" in e.value.hint and "\n" not in str(e.value)
    assert not (tmp_path / layout.step_dir_name(1)).exists()


@pytest.mark.parametrize(
    "name",
    [
        "model.safetensors",
        "model-00001-of-00002.safetensors",
        "model.safetensors.index.json",
        "adapter_model.safetensors",
        "adapter/adapter_model.safetensors",
        "stagerd.manifest.json",
        "weights-a.safetensors",  # the reference index's file: the export's shard
    ],
)
def test_an_extra_named_as_a_file_the_export_writes_is_refused_at_save(tmp_path, name):
    from stagerd import Stager

    with (
        Stager(tmp_path) as stager,
        pytest.raises(SaveInputError, match="names a file the export writes") as e,
    ):
        stager.save(
            {"w": torch.ones(2)}, 1, extras={name: b"x"}, reference_index={"w": "weights-a.safetensors"}
        )
    assert "rename the extra" in e.value.hint
    assert not (tmp_path / layout.step_dir_name(1)).exists()


def test_the_extras_the_export_takes_still_reach_it(tmp_path, caplog):
    """Config and tokenizer files reach the export as given (config.json with its dtype named); another
    safetensors extra stays in the step for `load()`, with a warning that the export leaves it out."""
    from stagerd import Stager

    save_inputs._left_out.cache_clear()  # once per name and process: said here, whatever ran before
    extras = {**TAKEN, "value_head.safetensors": b"head"}
    with Stager(tmp_path / "root") as stager, caplog.at_level(logging.WARNING, "stagerd.stager"):
        stager.save({"w": torch.arange(4.0)}, 1, extras=extras).result()
        stager.load({"w": torch.zeros(4)})
        assert stager.loaded is not None and stager.loaded.extras["value_head.safetensors"] == b"head"
    assert "'value_head.safetensors' is kept in the step for load() but left out of its export" in caplog.text
    out = tmp_path / "out"
    assert torch.equal(_export(tmp_path / "root" / layout.step_dir_name(1), out)["w"], torch.arange(4.0))
    exported = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert exported == sorted([*TAKEN, layout.WEIGHTS_NAME])
    for name, value in TAKEN.items():
        raw = (out / name).read_bytes()
        if name == "config.json":
            assert json.loads(raw)["model_type"] == "llama"
        else:
            assert raw == (
                value if isinstance(value, bytes) else (json.dumps(value, indent=2) + "\n").encode()
            )


def test_a_safetensors_extra_is_named_once_not_at_every_save(tmp_path, caplog):
    """A Trainer subclass's own safetensors file rides along with every save: one warning, not one a save."""
    from stagerd import Stager

    save_inputs._left_out.cache_clear()
    with Stager(tmp_path / "root") as stager, caplog.at_level(logging.WARNING, "stagerd.stager"):
        for step in (1, 2, 3):
            stager.save({"w": torch.arange(4.0)}, step, extras={"ema_once.safetensors": b"e"}).result()
    assert caplog.text.count("'ema_once.safetensors' is kept in the step for load()") == 1
