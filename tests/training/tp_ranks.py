"""What each gloo rank of a tensor-parallel save does: a tiny Llama under tensor parallelism (every
decoder Linear; the embeddings and the output layer too where untied), alone, under FSDP2 on the
data-parallel dim of a 2D (dp x tp) mesh, or HSDP without TP; saved through the Stager with the model;
rank 0 then writes `save_pretrained` of the gathered full state dict (`keep/`, and `bf16/`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.gloo import join

LAYER_PLAN = {"q_proj": "col", "k_proj": "col", "v_proj": "col", "o_proj": "row"}
MLP_PLAN = {"gate_proj": "col", "up_proj": "col", "down_proj": "row"}


def build(tied: bool) -> Any:
    import torch
    import transformers as tf

    cfg = tf.LlamaConfig(
        vocab_size=68, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(cfg)


def _tensor_parallel(model: Any, tp: Any, tied: bool) -> None:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    style = {"col": ColwiseParallel, "row": RowwiseParallel}
    for layer in model.model.layers:
        plan = {f"self_attn.{k}": style[v]() for k, v in LAYER_PLAN.items()}
        plan |= {f"mlp.{k}": style[v]() for k, v in MLP_PLAN.items()}
        parallelize_module(layer, tp, plan)
    if not tied:
        parallelize_module(model, tp, {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate()),
        })  # fmt: skip


def save(rank: int, world: int, init_file: str, cases: list[tuple[str, bool]], out: str) -> None:
    """Each case (layout, tied) in `out/<layout>-<tied>/` (`root/`, `ref/`), in one launch; `layout`:
    "fsdp_tp" (FSDP2 on dp of a 2 x world/2 mesh, TP on tp), "tp" (TP on every rank) or "hsdp" (FSDP2
    sharding over world/2 ranks, replicated twice). Then `resume` under "fsdp_tp", in `out/resume/`."""
    join(rank, world, init_file)
    for layout, tied in cases:
        d = Path(out) / case_dir(layout, tied)
        _save(rank, world, layout, tied, str(d / "root"), str(d / "ref"))
    resume(world, str(Path(out) / "resume"))


def case_dir(layout: str, tied: bool) -> str:
    return f"{layout}-{'tied' if tied else 'untied'}"


def parallel(world: int, layout: str, tied: bool) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = build(tied)
    dims = {"fsdp_tp": ("dp", "tp"), "hsdp": ("rep", "shard")}
    if layout == "tp":
        _tensor_parallel(model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)), tied)
        return model
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=dims[layout])
    if layout == "fsdp_tp":
        _tensor_parallel(model, mesh["tp"], tied)
    shard_on = mesh["dp"] if layout == "fsdp_tp" else mesh
    for layer in model.model.layers:
        fully_shard(layer, mesh=shard_on)
    fully_shard(model, mesh=shard_on)
    return model


def _save(rank: int, world: int, layout: str, tied: bool, root: str, ref: str) -> None:
    import torch
    from torch.distributed.tensor import DTensor

    from stagerd.training.stager import Stager

    model = parallel(world, layout, tied)
    with Stager(root) as stager:
        stager.save(model.state_dict(), step=1, model=model)
        stager.wait()
    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    if rank != 0:
        return
    plain = build(tied)
    plain.load_state_dict(full)
    plain.save_pretrained(Path(ref) / "keep")
    plain.to(torch.bfloat16).save_pretrained(Path(ref) / "bf16")


def resume(world: int, root: str) -> None:
    """A step of AdamW under FSDP2 + TP, saved with its optimizer state and loaded by `Stager.load` into
    a model trained otherwise: every rank's shards of the model and of the optimizer state come back."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.tensor import DTensor

    from stagerd.training.stager import Stager

    def trained(seed: int) -> tuple[Any, Any]:
        model = parallel(world, "fsdp_tp", False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ids = torch.randint(0, 68, (2, 9), generator=torch.Generator().manual_seed(seed))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        return model, opt

    model, opt = trained(1)
    saved_model, saved_optim = get_state_dict(model, opt)
    with Stager(root) as stager:
        stager.save(saved_model, step=1, optimizer_state=saved_optim, model=model)
        stager.wait()
    model, opt = trained(2)
    loaded_model, loaded_optim = get_state_dict(model, opt)
    with Stager(root) as stager:
        stager.load(loaded_model, loaded_optim)
    set_state_dict(model, opt, model_state_dict=loaded_model, optim_state_dict=loaded_optim)

    def local(t: Any) -> Any:
        return t.to_local() if isinstance(t, DTensor) else t

    got_model, got_optim = get_state_dict(model, opt)
    for k, v in saved_model.items():
        assert torch.equal(local(v), local(got_model[k])), k
    for p, state in saved_optim["state"].items():
        for k, v in state.items():
            assert torch.equal(local(v), local(got_optim["state"][p][k])), (p, k)
