"""`stagerd watch --adopt` on the folders Accelerate names itself: `save_state()` with
`ProjectConfiguration(automatic_checkpoint_naming=True)` writes `PROJECT/checkpoints/checkpoint_I`, I
counting its saves from 0. Each is published as step I; the newest is what `save_pretrained` writes of
the live model and loads back with `from_pretrained`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.adopt.helpers import assert_passed_over_once, published, tree_digest, watch_once
from tests.fidelity import models
from tests.fidelity.harness import assert_same_tensors

SAVES = 2


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    import transformers as tf
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    out = tmp_path_factory.mktemp("accelerate")
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(models.config("llama"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    naming = ProjectConfiguration(project_dir=str(out / "project"), automatic_checkpoint_naming=True)
    accelerator = Accelerator(cpu=True, project_config=naming)
    model, optimizer = accelerator.prepare(model, optimizer)
    ids = torch.randint(0, models.VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    for _ in range(SAVES):
        accelerator.backward(model(input_ids=ids, labels=ids).loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.save_state()  # checkpoints/checkpoint_0, then checkpoint_1
    accelerator.unwrap_model(model).save_pretrained(out / "ref")
    return out


def test_accelerates_automatic_checkpoint_names_are_published_as_steps(project, tmp_path):
    watched = project / "project" / "checkpoints"
    assert sorted(p.name for p in watched.iterdir()) == [f"checkpoint_{i}" for i in range(SAVES)]
    before = tree_digest(watched)
    res = watch_once(watched, tmp_path / "sink", "--extras", str(project / "ref"))
    out = res.stdout + res.stderr
    assert f"{SAVES} step(s) published, 0 not" in out, out
    newest = published(tmp_path / "sink", SAVES - 1)
    assert_same_tensors(newest, project / "ref")
    import transformers as tf

    loaded = tf.AutoModelForCausalLM.from_pretrained(newest).state_dict()
    ref = tf.AutoModelForCausalLM.from_pretrained(project / "ref").state_dict()
    assert all(torch.equal(loaded[k], ref[k]) for k in ref)
    assert tree_digest(watched) == before


def test_a_model_saved_as_a_pickle_is_named_once_and_left_alone(tmp_path):
    """`save_state(safe_serialization=False)` writes `pytorch_model.bin`, a pickle stagerd never reads:
    named once in a warning (not passed over in silence), nothing published, its files untouched."""
    import transformers as tf
    from accelerate import Accelerator

    model = tf.AutoModelForCausalLM.from_config(models.config("llama"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.save_state(str(tmp_path / "run" / "checkpoint_0"), safe_serialization=False)
    assert (tmp_path / "run" / "checkpoint_0" / "pytorch_model.bin").is_file()
    said = "checkpoint_0 holds the model as pytorch_model.bin (a pickle, never read)"
    assert_passed_over_once(tmp_path / "run", tmp_path / "sink", said)
