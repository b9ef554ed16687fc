"""An adopted checkpoint whose names no conversion is planned for (the HF Trainer's `model.safetensors`,
a DCP save of the Hub's names) keeps, cast to bf16, what its config.json's model keeps in float32: its
export is `save_pretrained` of the model `from_pretrained(dtype=torch.bfloat16)` loads. Before, only a
checkpoint of the model's live names got the list, and the others' DeepSeek V3 router was rounded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from stagerd.daemon.hf_names import model_plan
from stagerd.engine.adopt.export import export_adopted
from stagerd.engine.adopt.source import AdoptOptions, open_adopted
from stagerd.engine.verify import verify_export
from tests.adopt.helpers import published, watch_once
from tests.cli_helpers import run_cli
from tests.daemon_helpers import fast_flags
from tests.fidelity.harness import assert_same_weight_files, tensors
from tests.fidelity.registry.tiny import tiny_config

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]
ROUTER = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")  # DeepSeek V3's, kept in float32


def _model(model_type: str, cls: str) -> Any:
    """A tiny float32 model of `cls`, every floating tensor drawn (the zero score bias too)."""
    import torch
    import transformers as tf

    cfg = tiny_config(model_type)
    if hasattr(cfg, "first_k_dense_replace"):  # its one layer a MoE layer, which has the router
        cfg = tiny_config(model_type, first_k_dense_replace=0)
    torch.manual_seed(0)
    model = getattr(tf, cls)(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=g))
    return model.eval()


def _trainers(model: Any, run: Path, step: int = 1) -> Path:
    """run/checkpoint-N as the HF Trainer without FSDP writes it: save_pretrained, trainer_state.json last."""
    ckpt = run / f"checkpoint-{step}"
    model.save_pretrained(ckpt)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return ckpt


def _bf16(saved: Path, out: Path) -> Path:
    """save_pretrained of the model from_pretrained loads from `saved` in bf16."""
    import torch
    import transformers as tf

    tf.AutoModelForCausalLM.from_pretrained(saved, dtype=torch.bfloat16).save_pretrained(out)
    return out


def _f32(export: Path) -> set[str]:
    return {n for n, (dt, _, _) in tensors(export).items() if dt == "F32"}


def test_an_hf_trainer_checkpoint_cast_to_bf16_keeps_the_router_and_verifies(tmp_path, capsys):
    from stagerd.cli import main

    ckpt = _trainers(_model("deepseek_v3", "DeepseekV3ForCausalLM"), tmp_path / "run")
    ref = _bf16(ckpt, tmp_path / "ref")
    res = watch_once(tmp_path / "run", tmp_path / "sink", "--dtype", "bf16")
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "1 step(s) published, 0 not" in out, out
    export = published(tmp_path / "sink", 1)
    assert_same_weight_files(export, ref)
    f32 = _f32(export)
    assert f32 and all(n.endswith(ROUTER) for n in f32), f32
    assert main(["verify", str(export), "--against", str(ckpt), "--adopt"]) == 0  # in this process: quick
    assert "every byte equal to" in capsys.readouterr().out
    assert main(["consolidate", str(ckpt), str(tmp_path / "hf"), "--adopt", "--dtype", "bf16"]) == 0
    assert_same_weight_files(tmp_path / "hf", ref)


def test_a_daemon_without_transformers_casts_every_tensor_and_says_so_once(tmp_path):
    hidden = tmp_path / "hidden" / "transformers"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('hidden from this daemon by the test')\n")
    ckpt = _trainers(_model("deepseek_v3", "DeepseekV3ForCausalLM"), tmp_path / "run")
    shutil.copytree(ckpt, tmp_path / "run" / "checkpoint-2")  # two checkpoints, one word of it
    # `python -m stagerd.cli` imports from its working directory first: there, transformers fails to import
    res = run_cli(
        ["watch", tmp_path / "run", "--adopt", "--sink", f"file://{tmp_path / 'sink'}", "--once",
         "--dtype", "bf16", *fast_flags()],
        cwd=hidden.parent,
        timeout=180,
    )  # fmt: skip
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "2 step(s) published, 0 not" in out, out
    said = [line for line in out.splitlines() if "a cast export casts every tensor" in line]
    assert len(said) == 1 and '"level": "info"' in said[0] and "transformers fails to import" in said[0], out
    for step in (1, 2):
        assert {dt for dt, _, _ in tensors(published(tmp_path / "sink", step)).values()} == {"BF16"}


def test_a_dcp_save_of_the_hubs_names_keeps_the_router_too(tmp_path):
    """A trainer that saves save_pretrained's names in DCP (NeMo AutoModel's own MoE models) gets no
    conversion, and the list is matched on its names."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    saved = tmp_path / "saved"
    _model("deepseek_v3", "DeepseekV3ForCausalLM").save_pretrained(saved)
    ckpt = tmp_path / "root" / "step-1"
    dcp.save({"model": load_file(saved / "model.safetensors")}, checkpoint_id=str(ckpt), no_dist=True)
    shutil.copy(saved / "config.json", ckpt)
    options = AdoptOptions(model_plan=model_plan)
    source = open_adopted(ckpt, options)
    assert source.plan.origin == "mapping"  # no conversion planned: the names are kept
    export_adopted(ckpt, tmp_path / "work", options, dtype="bf16")
    export = tmp_path / "work" / "export"
    assert_same_weight_files(export, _bf16(saved, tmp_path / "ref"))
    assert verify_export(export, ckpt, source=source).tensors == len(tensors(export))
    f32 = _f32(export)
    assert f32 and all(n.endswith(ROUTER) for n in f32), f32


def test_a_llamas_checkpoint_casts_every_tensor(tmp_path):
    ckpt = _trainers(_model("llama", "LlamaForCausalLM"), tmp_path / "run")
    options = AdoptOptions(model_plan=model_plan)
    assert open_adopted(ckpt, options).plan.uncast == ()
    export_adopted(ckpt, tmp_path / "work", options, dtype="bf16")
    export = tmp_path / "work" / "export"
    assert_same_weight_files(export, _bf16(ckpt, tmp_path / "ref"))
    assert {dt for dt, _, _ in tensors(export).values()} == {"BF16"}
