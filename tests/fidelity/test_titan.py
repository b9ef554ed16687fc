"""A model whose state dict uses torchtitan's names, saved with the shipped torchtitan -> HF Llama key
mapping (renames and the RoPE row permutation), loads as an HF Llama with the trained model's logits."""

from __future__ import annotations

import pytest

from tests.fidelity import harness

pytestmark = pytest.mark.slow


def test_a_torchtitan_named_llama_loads_as_hf_llama(tmp_path):
    import torch

    run = harness.run("titan", tmp_path, mapping=True)
    keep = harness.tensors(run.exports["keep"])
    assert "model.layers.1.self_attn.q_proj.weight" in keep and "lm_head.weight" in keep
    assert not any("attention.wq" in k or "tok_embeddings" in k for k in keep)
    assert harness.config_dtype(run.exports["bf16"]) == "bfloat16"
    for mode, dtype in (("keep", "float32"), ("bf16", "bfloat16")):
        logits = harness.load_and_logits(run.exports[mode], dtype)
        want = torch.load(run.ref / "keep.logits.pt")
        # Another implementation of the same math (complex RoPE, torch's RMSNorm): equal up to rounding.
        tol = 1e-5 if mode == "keep" else 0.1
        assert torch.allclose(logits.float(), want, atol=tol, rtol=0), (
            mode,
            (logits.float() - want).abs().max(),
        )
