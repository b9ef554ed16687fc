"""A config.json that does not describe the adopted checkpoint's model (a head count alone, another size's)
stops that checkpoint at plan time with a ModelShapeError naming a tensor, its shape in the checkpoint and
the one config.json gives: before, the export was published and `from_pretrained` of it built the config's
model (a default 7B), and the process died without a word. So does a --mapping whose RoPE head counts are
not config.json's model's. Each checkpoint is a real `dcp.save` in this process; the model config.json
describes is built by transformers on the meta device."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from stagerd.daemon.hf_names import model_plan
from stagerd.engine.adopt.export import export_adopted
from stagerd.engine.adopt.source import AdoptOptions, open_adopted
from stagerd.errors import ModelShapeError

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]
HIDDEN, HEADS, KV, VOCAB, INTER = 64, 4, 2, 40, 48  # 4 heads of 16 rows: 16 heads of 4 divide them too
RIGHT: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": INTER,
    "num_hidden_layers": 1,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV,
}
TITAN = AdoptOptions("torchtitan", model_plan=model_plan)


def _titan(ckpt: Path, config: dict[str, Any], *, tied: bool = False) -> Path:
    """`ckpt` (step-N): torchtitan's names of a one-layer Llama (no `output` where its head is tied), with
    `config` as its config.json."""
    import torch
    import torch.distributed.checkpoint as dcp

    hd = HIDDEN // HEADS
    shapes = {
        "tok_embeddings.weight": (VOCAB, HIDDEN),
        "layers.0.attention.wq.weight": (HEADS * hd, HIDDEN),
        "layers.0.attention.wk.weight": (KV * hd, HIDDEN),
        "layers.0.attention.wv.weight": (KV * hd, HIDDEN),
        "layers.0.attention.wo.weight": (HIDDEN, HEADS * hd),
        "layers.0.feed_forward.w1.weight": (INTER, HIDDEN),
        "layers.0.feed_forward.w2.weight": (HIDDEN, INTER),
        "layers.0.feed_forward.w3.weight": (INTER, HIDDEN),
        "layers.0.attention_norm.weight": (HIDDEN,),
        "layers.0.ffn_norm.weight": (HIDDEN,),
        "norm.weight": (HIDDEN,),
        **({} if tied else {"output.weight": (VOCAB, HIDDEN)}),
    }
    g = torch.Generator().manual_seed(0)
    dcp.save(
        {k: torch.randn(*s, generator=g) for k, s in shapes.items()}, checkpoint_id=str(ckpt), no_dist=True
    )
    (ckpt / "config.json").write_text(json.dumps(config))
    return ckpt


def _hf_trainer(ckpt: Path, config: dict[str, Any], **over: Any) -> Path:
    """`ckpt` (checkpoint-N) as the HF Trainer writes it under FSDP's SHARDED_STATE_DICT: the model's live
    names in `pytorch_model_fsdp_0/`, `trainer_state.json` last; a tiny Llama of RIGHT's sizes and `over`,
    with `config` as its config.json."""
    import torch
    import torch.distributed.checkpoint as dcp
    import transformers as tf

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**{**RIGHT, **over}))
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt / "pytorch_model_fsdp_0"), no_dist=True)
    (ckpt / "config.json").write_text(json.dumps(config))
    (ckpt / "trainer_state.json").write_text('{"global_step": 1}')
    return ckpt


@pytest.mark.parametrize(
    ("config", "said"),
    [
        # the walk's: a head count alone, the rest LlamaConfig's defaults (a 7B), RoPE rows still divided
        ({"model_type": "llama", "num_attention_heads": 16}, r"'model\.embed_tokens\.weight' \(checkpoint "
         r"key 'tok_embeddings\.weight'\) is \[40, 64\] in the checkpoint, but config\.json's "
         r"LlamaForCausalLM gives \[32000, 4096\] \(and 11 other tensor\(s\)\)"),
        # another size's config of the same depth: every name the model's, one width not
        ({**RIGHT, "intermediate_size": 96}, r"'model\.layers\.0\.mlp\.gate_proj\.weight' \(checkpoint key "
         r"'layers\.0\.feed_forward\.w1\.weight'\) is \[48, 64\] in the checkpoint, but config\.json's "
         r"LlamaForCausalLM gives \[96, 64\]"),
        # the key/value heads left out: LlamaConfig then gives every head its own
        ({k: v for k, v in RIGHT.items() if k != "num_key_value_heads"}, r"'model\.layers\.0\.self_attn"
         r"\.k_proj\.weight' .* is \[32, 64\] in the checkpoint, but config\.json's LlamaForCausalLM gives "
         r"\[64, 64\]"),
    ],
)  # fmt: skip
def test_a_torchtitan_llama_with_another_models_config_is_refused_by_name(tmp_path, config, said):
    ckpt = _titan(tmp_path / "root" / "step-1", config)
    with pytest.raises(ModelShapeError, match=said) as e:
        export_adopted(ckpt, tmp_path / "work", TITAN)
    assert "--extras DIR" in e.value.hint and "\n" not in str(e.value)
    assert not (tmp_path / "work" / "export").exists()


def test_consolidate_and_verify_refuse_it_the_same_way(tmp_path, capsys):
    from stagerd.cli import main

    ckpt = _titan(tmp_path / "root" / "step-1", RIGHT)
    assert main(["consolidate", str(ckpt), str(tmp_path / "hf"), "--adopt"]) == 0
    assert main(["verify", str(tmp_path / "hf"), "--against", str(ckpt), "--adopt"]) == 0
    capsys.readouterr()
    (ckpt / "config.json").write_text(json.dumps({**RIGHT, "vocab_size": 32}))
    for argv in (
        ["consolidate", str(ckpt), str(tmp_path / "hf2"), "--adopt"],
        ["verify", str(tmp_path / "hf"), "--against", str(ckpt), "--adopt"],
    ):
        assert main(argv) != 0
        err = capsys.readouterr().err
        assert "ModelShapeError" in err and "'model.embed_tokens.weight'" in err and "[32, 64]" in err, err
        assert "--extras DIR" in err, err
    assert not (tmp_path / "hf2").exists()


def test_a_tied_torchtitan_llama_with_its_own_config_exports_without_a_head(tmp_path):
    ckpt = _titan(tmp_path / "root" / "step-1", {**RIGHT, "tie_word_embeddings": True}, tied=True)
    names = {v.name for v in open_adopted(ckpt, TITAN).plan.views}
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    (ckpt / "config.json").write_text(json.dumps({**RIGHT, "tie_word_embeddings": True, "hidden_size": 32}))
    with pytest.raises(ModelShapeError, match=r"'model\.embed_tokens\.weight' .* gives \[40, 32\]"):
        open_adopted(ckpt, TITAN)


def test_a_mapping_whose_rope_heads_are_not_the_configs_models_is_refused(tmp_path):
    """The shipped example mapping holds Llama 3 8B's head counts (32, 8): for this model they divide the
    rows as well, in heads of 2 rows where it rotates 16; no shape tells."""
    ckpt = _titan(tmp_path / "root" / "step-1", RIGHT)
    example = Path(__file__).resolve().parents[2] / "examples" / "torchtitan_llama_to_hf.json"
    options = AdoptOptions("torchtitan", mapping=example, model_plan=model_plan)
    with pytest.raises(ModelShapeError, match=r"in 32 heads of 2 rows .* rotates 16 rows per head") as e:
        open_adopted(ckpt, options)
    assert "rope_heads in --mapping FILE" in e.value.hint
    spec = json.loads(example.read_text())
    for rule in spec["rules"]:
        if "rope_heads" in rule:
            rule["rope_heads"] = KV if "wk" in rule["match"] else HEADS
    (tmp_path / "mapping.json").write_text(json.dumps(spec))
    assert open_adopted(
        ckpt, AdoptOptions("torchtitan", mapping=tmp_path / "mapping.json", model_plan=model_plan)
    )


@pytest.mark.parametrize(
    ("config", "said"),
    [
        # every name the model's: the model found by its names holds other shapes
        ({**RIGHT, "intermediate_size": 96}, r"^'model\.layers\.0\.mlp\.gate_proj\.weight' is \[48, 64\] in "
         r"the checkpoint, but config\.json's LlamaForCausalLM gives \[96, 64\]"),
        # a default's depth: the names kept (with a warning), their shapes still not the model's
        ({"model_type": "llama"}, r"'model\.embed_tokens\.weight' \(checkpoint key 'model\.model\."
         r"embed_tokens\.weight'\) is \[40, 64\] in the checkpoint, but config\.json's LlamaForCausalLM "
         r"gives \[32000, 4096\]"),
    ],
)  # fmt: skip
def test_an_hf_trainer_fsdp_checkpoint_with_another_models_config_is_refused(tmp_path, config, said):
    ckpt = _hf_trainer(tmp_path / "run" / "checkpoint-1", config)
    with pytest.raises(ModelShapeError, match=said):
        open_adopted(ckpt, AdoptOptions(model_plan=model_plan))
    (ckpt / "config.json").write_text(json.dumps(RIGHT))
    assert open_adopted(ckpt, AdoptOptions(model_plan=model_plan)).plan.origin == "transformers"


def test_a_peft_adapter_is_not_held_to_its_base_models_config(tmp_path):
    """An adapter's shapes are its rank's, not the base model's (whose config.json it may come with)."""
    import torch
    from safetensors.torch import save_file

    ckpt = tmp_path / "run" / "checkpoint-4"
    ckpt.mkdir(parents=True)
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    save_file({name: torch.randn(2, 8), name.replace("lora_A", "lora_B"): torch.randn(8, 2)},
              ckpt / "adapter_model.safetensors", metadata={"format": "pt"})  # fmt: skip
    (ckpt / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 2}')
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llama", "num_attention_heads": 16}))
    (ckpt / "trainer_state.json").write_text("{}")
    r = export_adopted(ckpt, tmp_path / "work", AdoptOptions(model_plan=model_plan))
    assert [f for f, _ in r.files] == ["adapter_config.json", "adapter_model.safetensors"]
