"""A PEFT LoRA Llama under FSDP2: the export holds the adapter-only artefact PEFT loads, with PEFT's saved
names, bit for bit what `PeftModel.save_pretrained` writes."""

from __future__ import annotations

import json

import pytest

from tests.fidelity import harness, models, ranks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    return harness.run("llama_lora", tmp_path_factory.mktemp("lora"), model=True)


def test_the_adapter_is_what_peft_save_pretrained_writes(lora):
    for mode in ("keep", "bf16"):
        adapter, ref = lora.exports[mode] / "adapter", lora.ref / mode
        assert sorted(p.name for p in adapter.iterdir()) == [
            "adapter_config.json",
            "adapter_model.safetensors",
        ]
        got, want = harness.tensors(adapter), harness.tensors(ref)
        assert got == want and any(".lora_A.weight" in k for k in got), sorted(got)
        config = json.loads((adapter / "adapter_config.json").read_text())
        assert config == json.loads((ref / "adapter_config.json").read_text())


def test_peft_loads_the_trained_adapter_bit_for_bit(lora):
    import peft
    import torch

    torch.manual_seed(0)
    base = models.build("llama")
    model = peft.PeftModel.from_pretrained(base, lora.exports["keep"] / "adapter")
    model.eval()
    want = harness.tensors(lora.ref / "keep")
    loaded = {k: v for k, v in model.state_dict().items() if ".lora_" in k}
    assert len(loaded) == len(want)
    for k, v in loaded.items():
        saved = k.replace(".default.", ".")
        assert v.contiguous().view(torch.uint8).numpy().tobytes() == want[saved][2], k
    with torch.no_grad():
        logits = model(input_ids=ranks.input_ids()).logits
    assert torch.equal(logits, torch.load(lora.ref / "keep.logits.pt"))
