"""Without `model=`: `extras["config.json"]` of a transformers architecture is enough for an export that is
what `save_pretrained` writes (the model is built once on the meta device from the config); where it is
not, one warning names `model=`. One process, no gloo: the plan is resolved the same way on rank 0."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from stagerd import Stager
from stagerd.contract import commit_marker, layout
from stagerd.engine.export import export_step
from tests.fidelity import harness, models


def _ours(caught):
    return [w for w in caught if "model=" in str(w.message)]


def _save_and_export(tmp_path, sd, config, step=1):
    with Stager(tmp_path / "root", checkpointer="thread") as stager:
        stager.save(sd, step=step, extras={"config.json": config})
        stager.wait()
    step_dir = tmp_path / "root" / layout.step_dir_name(step)
    export_step(step_dir)
    return step_dir


@pytest.mark.parametrize("kind", ["llama_tied", "qwen3_moe"])
def test_the_config_alone_gives_what_save_pretrained_writes(tmp_path, kind):
    """The tied `lm_head.weight` is left out; Qwen3-MoE's fused experts are split per expert."""
    torch.manual_seed(0)
    model = models.build(kind)
    config = json.loads(model.config.to_json_string())
    assert not config.get("architectures")  # built from a config: only model_type names the model
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step_dir = _save_and_export(tmp_path, model.state_dict(), config)
    assert not _ours(caught)  # no warning: the plan was found
    model.save_pretrained(tmp_path / "ref")
    harness.assert_same_tensors(step_dir / layout.EXPORT_DIR, tmp_path / "ref")
    plan = commit_marker.read_marker(step_dir).hub_plan
    assert plan is not None and plan.origin == "transformers"


def _save_wrapped(tmp_path, wrapper, model, given: str) -> None:
    """Step 1 of `wrapper`, which holds `model`: given as model=, or described by the model's config."""
    with Stager(tmp_path / "root", checkpointer="thread") as stager:
        if given == "model":
            stager.save(wrapper.state_dict(), step=1, model=wrapper)
        else:
            stager.save(wrapper.state_dict(), step=1, extras={"config.json": model.config.to_dict()})
        stager.wait()


@pytest.mark.parametrize("given", ["config", "model"])
def test_a_wrapped_model_is_found_under_its_prefix(tmp_path, given):
    """A LightningModule-like wrapper, given as model= or described by its config: its keys carry the
    attribute's prefix, and a key of its own is staged for resuming but not exported."""
    torch.manual_seed(0)
    model = models.build("llama_tied")
    wrapper = torch.nn.Module()
    wrapper.net = model
    wrapper.head = torch.nn.Linear(2, 2)
    _save_wrapped(tmp_path, wrapper, model, given)
    step_dir = tmp_path / "root" / layout.step_dir_name(1)
    export_step(step_dir)
    model.save_pretrained(tmp_path / "ref")
    harness.assert_same_tensors(step_dir / layout.EXPORT_DIR, tmp_path / "ref")
    assert "net.model.embed_tokens.weight" in commit_marker.read_marker(step_dir).tensors  # staged as named


def test_keys_the_config_does_not_describe_warn_once_naming_model(tmp_path, monkeypatch):
    from stagerd.training import to_hub

    monkeypatch.setattr(to_hub, "_warned", set())  # once per process: another test may have said it first
    torch.manual_seed(0)
    model = models.build("llama")
    sd = {k.replace("self_attn.", "attention."): v for k, v in model.state_dict().items()}
    config = model.config.to_dict()
    with Stager(tmp_path / "root", checkpointer="thread") as stager:
        with pytest.warns(UserWarning, match=r"own names.*model=model"):
            stager.save(sd, step=1, extras={"config.json": config})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            stager.save(sd, step=2, extras={"config.json": config})
            stager.wait()
        assert not _ours(caught)  # said once
    export_step(tmp_path / "root" / layout.step_dir_name(1))
    got = harness.tensors(tmp_path / "root" / layout.step_dir_name(1) / layout.EXPORT_DIR)
    assert set(got) == set(sd)  # in-memory names, as staged


def test_a_config_of_another_model_says_nothing(tmp_path):
    """A config.json that names no transformers architecture is just an extra: no warning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _save_and_export(tmp_path, {"w": torch.ones(2), "v": torch.ones(3)}, {"model_type": "tiny"})
    assert not _ours(caught)


@pytest.mark.parametrize("given", ["config", "model"])
def test_a_wrapped_moe_model_is_sharded_as_save_pretrained_shards_it(tmp_path, given):
    """Under a prefix too, the experts split from one fused tensor share a file and are sized by it, and
    the index counts the model's parameters. Before, the prefixed plan kept only the views and the order:
    7 files where save_pretrained writes 9."""
    torch.manual_seed(0)
    model = models.build("qwen3_moe")
    wrapper = torch.nn.Module()
    wrapper.net = model
    _save_wrapped(tmp_path, wrapper, model, given)
    export = export_step(tmp_path / "root" / layout.step_dir_name(1), max_shard_size=20_000).export_dir
    model.save_pretrained(tmp_path / "ref", max_shard_size=20_000)
    harness.assert_same_weight_files(export, tmp_path / "ref")


def test_a_wrapped_model_whose_conversion_pads_with_zeros_saves_and_exports(tmp_path):
    """Inkling2's checkpoint pads the vocabulary with zero rows. Before, the prefixed plan looked the zero
    fill up among the staged keys: the save was refused (`SaveInputError: KeyError: '...#zeros0'`)."""
    import transformers as tf

    from tests.fidelity.registry import cases as registry
    from tests.fidelity.registry.check import build

    if not hasattr(tf, "Inkling2LoopForCausalLM"):
        pytest.skip(f"transformers {tf.__version__} has no Inkling2")
    case = registry.Case("inkling2_loop_text", "Inkling2LoopForCausalLM", over=(("unpadded_vocab_size", 56),))
    model = build(case)
    wrapper = torch.nn.Module()
    wrapper.net = model
    with Stager(tmp_path / "root", checkpointer="thread") as stager:
        stager.save(wrapper.state_dict(), step=1, model=wrapper)
        stager.wait()
    export = export_step(tmp_path / "root" / layout.step_dir_name(1)).export_dir
    model.save_pretrained(tmp_path / "ref")
    harness.assert_same_weight_files(export, tmp_path / "ref")
