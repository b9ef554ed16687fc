"""A PEFT LoRA Llama under FSDP2: the export holds the adapter-only artefact PEFT loads, with PEFT's saved
names, bit for bit what `PeftModel.save_pretrained` writes; its main export is `save_pretrained` of
`merge_and_unload()`, bit for bit, the merged weights too, which `from_pretrained` loads."""

from __future__ import annotations

import json

import pytest

from tests.fidelity import harness, models, ranks
from tests.fidelity.ulps import values

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
        config = _config(adapter / "adapter_config.json")
        assert config == _config(ref / "adapter_config.json")


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


def _config(path):
    # PEFT keeps target_modules as a set and writes list(set): its order follows the writing process's
    # string hash seed, so two processes (the trainer, the reference) may order it differently.
    config = json.loads(path.read_text())
    if isinstance(config.get("target_modules"), list):
        config["target_modules"] = sorted(config["target_modules"])
    return config


def test_the_main_export_is_save_pretrained_of_the_merged_model(lora):
    import numpy as np
    import torch

    torch.manual_seed(0)
    base = {k: v.double().numpy() for k, v in models.build("llama").state_dict().items()}

    for mode in ("keep", "bf16"):
        got, want = harness.tensors(lora.exports[mode]), harness.tensors(lora.ref / f"merged_{mode}")
        assert sorted(got) == sorted(want)
        assert not any("lora_" in k or "base_layer" in k or k.startswith("base_model.") for k in got)
        merged = [k for k in want if k.endswith(("q_proj.weight", "v_proj.weight"))]
        assert len(merged) == 4
        for name, (dt, shape, data) in want.items():
            assert got[name][:2] == (dt, shape), (name, got[name][:2], (dt, shape))
            # W + scaling * (B @ A) summed as torch sums it (engine/torch_sum.py): bit for bit, as the rest
            assert got[name][2] == data, f"{name}: bytes differ"
            if name in merged:  # the merge happened: far from the (frozen) base weight
                g, w = values(got[name]), values(want[name])
                assert np.abs(g - base[name]).max() > 0.1 * np.abs(w).max(), name
        assert harness.config_dtype(lora.exports[mode]) == harness.config_dtype(lora.ref / f"merged_{mode}")


def test_from_pretrained_loads_the_merged_export(lora):
    import torch

    from stagerd.contract import layout
    from tests.cli_helpers import run_cli

    logits = harness.load_and_logits(lora.exports["keep"], "float32")  # no missing or unexpected key
    torch.testing.assert_close(logits, torch.load(lora.ref / "merged.logits.pt"), rtol=1e-5, atol=1e-5)
    # the unmerged model's logits are those of the merge (the LoRA delta is not lost)
    torch.testing.assert_close(logits, torch.load(lora.ref / "keep.logits.pt"), rtol=1e-4, atol=1e-4)
    step = lora.root / layout.step_dir_name(ranks.STEP)
    res = run_cli(["verify", step / layout.EXPORT_DIR, "--against", step])  # recomputes the merges
    assert res.returncode == 0, res.stdout + res.stderr


def test_a_fleet_of_two_nodes_publishes_the_same_merged_export_and_adapter(lora, tmp_path):
    """The trained step staged node-locally on 2 nodes (issue 14): the fleet carries out PEFT's own plans,
    every LoRA merge computed by the main file's owner from blocks of both nodes, and publishes every file,
    `adapter/` included, byte for byte as the single daemon did."""
    from stagerd.contract import commit_marker, layout
    from stagerd.daemon.fleet.node import FleetResult
    from tests.fleet_helpers import run_fleet, split_step

    step = lora.root / layout.step_dir_name(ranks.STEP)
    marker = commit_marker.read_marker(step)
    assert marker.hub_plan is not None and marker.hub_plan.merges and marker.adapter_plan is not None
    node_dirs = split_step(step, tmp_path, 2)
    assert all(any((d / layout.MODEL_DIR).iterdir()) for d in node_dirs)
    sink = tmp_path / "sink"
    results = run_fleet(node_dirs, sink.as_uri(), exchange=(tmp_path / "exchange").as_uri())
    assert all(isinstance(r, FleetResult) for r in results), results
    assert [sorted(r.built) for r in results] == [  # type: ignore[union-attr]
        ["model.safetensors"],
        ["adapter/adapter_model.safetensors"],
    ]

    def tree(root):
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}

    got, want = tree(sink / step.name), tree(lora.exports["keep"])
    manifests = [json.loads(t.pop(layout.MANIFEST_NAME)) for t in (got, want)]
    assert got == want and manifests[0]["files"] == manifests[1]["files"]
