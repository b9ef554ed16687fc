"""Train a tiny transformer under FSDP2 on CPU (gloo) and save every N steps through `stagerd.Stager`.

    python examples/train_tiny.py --root /tmp/ckpt                  # 2 processes via mp.spawn
    torchrun --nproc-per-node 2 examples/train_tiny.py --root /tmp/ckpt
    stagerd consolidate /tmp/ckpt/step-00000010 /tmp/out            # or let `stagerd watch` do it

Tensor names follow the Hugging Face Llama layout, so the export is a loadable-looking HF checkpoint.
The loop shows where the two waits go: `save()` right after the optimizer step, `wait_staged()` just
before the next one (forward and backward overlap the host copy), `wait()` once before exit.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

CONFIG = {
    "architectures": ["TinyLlamaForCausalLM"],
    "model_type": "tiny",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "torch_dtype": "float32",
}


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            p(x).view(b, t, self.heads, d // self.heads).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int, heads: int) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(dim)
        self.self_attn = Attention(dim, heads)
        self.post_attention_layernorm = nn.RMSNorm(dim)
        self.mlp = MLP(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        dim = cfg["hidden_size"]
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], dim)
        self.layers = nn.ModuleList(
            Block(dim, cfg["intermediate_size"], cfg["num_attention_heads"])
            for _ in range(cfg["num_hidden_layers"])
        )
        self.norm = nn.RMSNorm(dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class TinyLM(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.model = Body(cfg)
        self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(ids))


def train(args: argparse.Namespace) -> None:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from stagerd import Stager

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # same initial weights on every rank
    model = TinyLM(CONFIG)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches

    stager = Stager(args.root)
    t_start, stalls, pending = time.perf_counter(), [], None
    for step in range(1, args.steps + 1):
        ids = torch.randint(0, CONFIG["vocab_size"], (args.batch, args.seq + 1), generator=data)
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))
        loss.backward()
        t0 = time.perf_counter()
        stager.wait_staged()  # the previous save's host copy must finish before parameters change
        if pending is not None:
            stalls.append(pending + time.perf_counter() - t0)
            pending = None
        opt.step()
        opt.zero_grad()
        if step % args.save_every == 0:
            t0 = time.perf_counter()
            stager.save(
                model.state_dict(),
                step,
                extras={"config.json": CONFIG},
                dtype=args.dtype,
                optimizer_state=get_optimizer_state_dict(model, opt),
                metadata={"run": "train_tiny", "loss": round(loss.item(), 4)},
            )
            pending = time.perf_counter() - t0
        if rank == 0 and step % args.save_every == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    markers = stager.wait()
    if args.dump_final:
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}  # collective: every rank
        if rank == 0:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in full.items()}, args.dump_final)
    stager.close()
    if rank == 0:
        steps = [m.step for m in markers]
        mean = sum(stalls) / len(stalls) if stalls else 0.0
        print(
            f"done: {args.steps} steps in {time.perf_counter() - t_start:.1f} s; committed {steps} under "
            f"{args.root}; training stall per save {mean * 1000:.1f} ms (save() + wait_staged())",
            flush=True,
        )


def _spawned(rank: int, world: int, init_file: str, args: argparse.Namespace) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        train(args)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", required=True, type=Path, help="staging root (node-local disk)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--nproc", type=int, default=2, help="processes to spawn when not under torchrun")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--dtype", default=None, help="export dtype hint for the daemon: bf16, fp16, fp32, keep")
    p.add_argument("--dump-final", default=None, help="also write the final full weights here (safetensors)")
    args = p.parse_args(argv)
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("gloo")
        try:
            train(args)
        finally:
            dist.destroy_process_group()
        return
    import torch.multiprocessing as mp

    fd, init_file = tempfile.mkstemp(prefix="train-tiny-")
    os.close(fd)
    os.unlink(init_file)
    try:
        mp.start_processes(
            _spawned, args=(args.nproc, init_file, args), nprocs=args.nproc, start_method="spawn"
        )
    finally:
        if os.path.exists(init_file):
            os.unlink(init_file)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
    main()
