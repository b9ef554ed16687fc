"""LoRA with `trainable_token_indices` under FSDP2 on 2 gloo ranks: the main export is `save_pretrained`
of `merge_and_unload()`, byte for byte, the embedding's trained rows merged in. Before, it held PEFT's
`model.embed_tokens.token_adapter.{weight,trainable_tokens_delta.default}`, and `from_pretrained`
initialised `model.embed_tokens.weight` at random without a warning."""

from __future__ import annotations

import pytest

from stagerd.contract import commit_marker, layout
from stagerd.engine.export import build_export
from stagerd.engine.source import open_source
from tests.fidelity import harness
from tests.gloo import launch
from tests.training import peft_tokens_ranks as ranks

pytest.importorskip("peft")
pytestmark = pytest.mark.slow

CASES = [(False, 1), (True, 1), (False, 2)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Every case saved in one launch (starting the ranks costs more than a save)."""
    out = tmp_path_factory.mktemp("tokens")
    launch(ranks.save, CASES, str(out), world=2, deadline_s=150)
    return out


@pytest.mark.parametrize(("tied", "adapters"), CASES)
def test_the_merged_export_is_merge_and_unload_save_pretrained(tied, adapters, saved, tmp_path):
    d = saved / ranks.case_dir(tied, adapters)
    step = d / "root" / layout.step_dir_name(1)
    plan = commit_marker.read_marker(step).hub_plan
    assert plan is not None and plan.origin == "peft"  # merged, not the fallback to PEFT's own names
    for mode, dtype, limit in (
        ("merged", None, 1 << 40),
        ("merged_sharded", None, ranks.SHARD),
        ("merged_bf16", "BF16", 1 << 40),
    ):
        out = tmp_path / mode
        out.mkdir()
        build_export(
            open_source(step), out, dtype=dtype, keep_dtype=None, reference=None, max_shard_size=limit,
            threads=1, progress=None,
        )  # fmt: skip
        harness.assert_same_tensors(out, d / "ref" / mode)
        harness.assert_same_weight_files(out, d / "ref" / mode)
        assert (out / "config.json").read_bytes() == (d / "ref" / mode / "config.json").read_bytes()


def test_token_rows_of_another_dtype_keep_peft_names_with_a_warning(tmp_path, caplog):
    """A bfloat16 base under PEFT's default autocast keeps the token rows in float32: merge_and_unload()
    rounds them, a cast the plan does not express. The main export keeps PEFT's names and a warning names
    the layer, not a model that loads with its embeddings at random."""
    import peft
    import torch
    import transformers as tf

    from stagerd import Stager

    cfg = tf.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    torch.manual_seed(0)
    lora = peft.LoraConfig(r=4, target_modules=["q_proj"], trainable_token_indices=[1, 5])
    model = peft.get_peft_model(tf.LlamaForCausalLM(cfg).to(torch.bfloat16), lora)
    with Stager(tmp_path / "root") as stager:
        stager.save(model.state_dict(), 1, model=model).result()
    plan = commit_marker.read_marker(tmp_path / "root" / layout.step_dir_name(1)).hub_plan
    assert plan is None or plan.origin != "peft"
    words = "'base_model.model.model.embed_tokens': its trainable tokens are torch.float32"
    assert any("keeps the PEFT model's own names" in r.message and words in r.message for r in caplog.records)
