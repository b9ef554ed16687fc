"""LoRA with `trainable_token_indices` on a bfloat16 model under PEFT's default `autocast_adapter_dtype`:
the token rows are float32, and `merge_and_unload()` casts them to bf16 (`.to(weight)`) before copying
them in. The merged export is `save_pretrained` of `merge_and_unload()` byte for byte, untied and tied.
Before, the plan was refused for the cast and the export kept PEFT's in-memory names."""

from __future__ import annotations

import copy

import pytest

from stagerd.contract import commit_marker, layout
from stagerd.contract.lora_merge import MergeKind
from stagerd.engine.export import build_export
from stagerd.engine.source import open_source
from tests.fidelity import harness
from tests.training.tiny_llama import tiny_llama

pytest.importorskip("peft")

# Unsorted, adjacent runs, the first and the last row.
INDICES = [63, 0, 7, 6, 8, 2, 30]


def _build(tied: bool):
    import peft
    import torch

    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], trainable_token_indices=INDICES)
    model = peft.get_peft_model(tiny_llama(dtype="bfloat16", tied=tied), lora)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_" in n or "trainable_tokens_delta" in n:
                assert p.dtype == torch.float32, n  # PEFT's autocast keeps the adapter in float32
                # float32 values bf16 cannot hold: the merge rounds them, ties and a NaN included
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
                if "trainable_tokens_delta" in n:
                    p[0, :3] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, float("nan")])
    return model


@pytest.mark.parametrize("tied", [False, True])
def test_float32_token_rows_of_a_bf16_model_merge_as_merge_and_unload(tied, tmp_path):
    import torch

    from stagerd import Stager

    model = _build(tied)
    with Stager(tmp_path / "root") as stager:
        stager.save(model.state_dict(), 1, model=model).result()
    step = tmp_path / "root" / layout.step_dir_name(1)
    plan = commit_marker.read_marker(step).hub_plan
    assert plan is not None and plan.origin == "peft"  # merged, not the fallback to PEFT's own names
    assert [m.dtype for m in plan.merges if m.kind is MergeKind.CAST] == ["BF16"]
    merged = copy.deepcopy(model).merge_and_unload()
    assert merged.get_input_embeddings().weight.dtype == torch.bfloat16
    for mode, dtype, ref in (
        ("keep", None, merged),
        ("f32", "F32", copy.deepcopy(merged).to(torch.float32)),
    ):
        ref.save_pretrained(tmp_path / "ref" / mode)
        out = tmp_path / mode
        out.mkdir()
        build_export(
            open_source(step), out, dtype=dtype, keep_dtype=None, reference=None, max_shard_size=1 << 40,
            threads=1, progress=None,
        )  # fmt: skip
        harness.assert_same_tensors(out, tmp_path / "ref" / mode)
        harness.assert_same_weight_files(out, tmp_path / "ref" / mode)


def test_verify_recomputes_the_cast_and_an_older_reader_refuses_it(tmp_path):
    """verify_export casts the rows again and names a flipped byte of one; a marker read without its
    `cast_merges` (a stagerd that does not know them) refuses the rows' parts instead of exporting them."""
    from stagerd import Stager
    from stagerd.contract.hub_plan import HubPlan
    from stagerd.engine.verify import verify_export
    from stagerd.errors import HubPlanError, VerifyError

    model = _build(False)
    with Stager(tmp_path / "root") as stager:
        stager.save(model.state_dict(), 1, model=model).result()
    step = tmp_path / "root" / layout.step_dir_name(1)
    out = tmp_path / "out"
    out.mkdir()
    build_export(
        open_source(step),
        out,
        dtype=None,
        keep_dtype=None,
        reference=None,
        max_shard_size=6000,
        threads=1,
        progress=None,
    )  # fmt: skip (sharded: an index names each tensor's file)
    verify_export(out, step)
    name = "model.embed_tokens.weight"
    at = 7 * 32 * 2 + 5  # a byte of row 7, a trained row
    harness.flip_byte(out, name, at)
    with pytest.raises(VerifyError) as e:
        verify_export(out, step)
    assert f"tensor {name!r} (its byte {at}) differs" in e.value.message, e.value.message

    plan = commit_marker.read_marker(step).hub_plan
    assert plan is not None
    older = {k: v for k, v in plan.to_json().items() if k != "cast_merges"}
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    shapes |= {m.name: shapes[m.base] for m in plan.merges if m.kind is not MergeKind.CAST}  # computed
    with pytest.raises(HubPlanError, match="which was not saved"):
        HubPlan.from_json(older).outputs(shapes)
