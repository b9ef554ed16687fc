"""A torchtitan Qwen3 run (torchtitan's own model package and CheckpointManager: titan_qwen3_ranks.py),
dense and MoE: `watch --adopt` with its config.json plans the names with torchtitan's own
`Qwen3StateDictAdapter.to_hf` and publishes each step as exactly what to_hf gives (names, shapes, bytes;
the tied head left out, grouped experts split per expert), the dense one equal to `save_pretrained` of
those weights, both loadable by `from_pretrained`."""

from __future__ import annotations

import pytest

from tests.adopt import titan_qwen3_ranks
from tests.adopt.helpers import published, watch_once
from tests.fidelity import harness
from tests.gloo import launch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=[False, True], ids=["dense", "moe"])
def run(request, tmp_path_factory):
    moe = request.param
    tmp = tmp_path_factory.mktemp("titan-moe" if moe else "titan-dense")
    base, ref = tmp / "run", tmp / "ref"
    ref.mkdir()
    launch(titan_qwen3_ranks.save_and_reference, str(base), str(ref), moe, world=1, deadline_s=240)
    res = watch_once(base / "checkpoint", tmp / "out", "--extras", str(base))
    assert res.returncode == 0, res.stdout + res.stderr
    return moe, tmp


def _tensors(d):
    from safetensors import safe_open

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(f, "pt") as s:
            out.update({k: s.get_tensor(k) for k in s.keys()})  # noqa: SIM118
    return out


def test_each_step_is_torchtitans_to_hf(run):
    import torch

    _, tmp = run
    last = published(tmp / "out", titan_qwen3_ranks.STEPS)
    got, want = _tensors(last), _tensors(tmp / "ref")
    assert sorted(got) == sorted(want), (sorted(set(got) - set(want)), sorted(set(want) - set(got)))
    for name, w in want.items():
        assert got[name].dtype == w.dtype and got[name].shape == w.shape, name
        assert torch.equal(got[name].view(-1).view(torch.uint8), w.view(-1).view(torch.uint8)), name
    assert published(tmp / "out", 1).is_dir()


def test_the_dense_export_is_save_pretrained_and_both_load(run):
    moe, tmp = run
    last = published(tmp / "out", titan_qwen3_ranks.STEPS)
    if not moe:
        harness.assert_same_tensors(last, tmp / "ref" / "last")
    harness.load_and_logits(last, "float32")


def test_a_config_json_that_is_not_the_checkpoints_model_is_refused_by_name():
    """to_hf's result must be what save_pretrained of config.json's model writes, shape for shape: a
    config.json of another size is refused (the daemon warns and the preset's rules decide)."""
    import torch

    from stagerd.daemon.titan_names import titan_plan
    from stagerd.errors import HubPlanError

    with torch.device("meta"):
        model = titan_qwen3_ranks.titan_config(moe=False).build()
    tensors = {k: (tuple(v.shape), "F32") for k, v in model.state_dict().items()}
    config = titan_qwen3_ranks.hf_config(moe=False).to_dict()
    assert titan_plan(tensors, config) is not None
    with pytest.raises(HubPlanError, match=r"other shapes \['model.layers.0.mlp.down_proj.weight'"):
        titan_plan(tensors, {**config, "intermediate_size": 2 * titan_qwen3_ranks.HIDDEN})
    assert titan_plan(tensors, {**config, "model_type": "llama"}) is None  # Llama keeps its rules


@pytest.mark.parametrize("value", [True, 0, -8, 2.0, "8"])
def test_a_config_json_expert_count_that_is_no_count_is_refused_by_name(value):
    """JSON's `true` is an int to Python: it reached torchtitan as one expert, which failed unexplained."""
    import torch

    from stagerd.daemon.titan_names import titan_plan
    from stagerd.errors import HubPlanError

    with torch.device("meta"):
        model = titan_qwen3_ranks.titan_config(moe=True).build()
    tensors = {k: (tuple(v.shape), "F32") for k, v in model.state_dict().items()}
    config = titan_qwen3_ranks.hf_config(moe=True).to_dict()
    config = {k: v for k, v in config.items() if k not in ("num_local_experts", "n_routed_experts")}
    with pytest.raises(HubPlanError, match="gives no num_experts"):
        titan_plan(tensors, {**config, "num_experts": value})
