"""A tiny Mistral Large 4 under FSDP2: transformers' registry reverts its vision q/k projections with
`PermuteForRope` on save (rows regrouped per head: view, transpose, reshape); the export plans it as a
permutation of row blocks and holds what `save_pretrained` writes, bit for bit."""

from __future__ import annotations

import pytest

from tests.fidelity import harness

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return harness.run("mistral_large4", tmp_path_factory.mktemp("ml4"), model=True)


def test_the_permuted_rows_are_what_save_pretrained_writes(run):
    for mode in ("keep", "bf16"):
        harness.assert_same_tensors(run.exports[mode], run.ref / mode)
        got = harness.tensors(run.exports[mode])
        permuted = [
            k for k in got if k.startswith("vision_encoder.") and k.endswith(("wq.weight", "wk.weight"))
        ]
        assert len(permuted) == 2, sorted(got)


def test_the_export_loads_to_the_trained_logits_and_verifies(run):
    import torch
    import transformers as tf

    from stagerd.contract import layout
    from tests.cli_helpers import run_cli
    from tests.fidelity import ranks

    model, info = tf.MistralLarge4ForConditionalGeneration.from_pretrained(
        run.exports["keep"], output_loading_info=True
    )
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info[key], (key, info[key])
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ranks.input_ids()).logits
    assert torch.equal(logits, torch.load(run.ref / "keep.logits.pt"))
    step = run.root / layout.step_dir_name(ranks.STEP)
    res = run_cli(["verify", step / layout.EXPORT_DIR, "--against", step])  # re-derives the permutation
    assert res.returncode == 0, res.stdout + res.stderr
