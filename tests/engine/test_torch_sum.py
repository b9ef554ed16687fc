"""engine/torch_sum.py sums a LoRA product B @ A as torch's CPU matmul does, bit for bit: along the rank
in order, each step a fused multiply-add rounded once, where numpy's matmul sums in an order of its own."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

from stagerd.engine import torch_sum


def _wide_range(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-20, 20, shape, generator=g).float())


def test_each_rank_step_is_rounded_once_as_an_fma_rounds_it():
    # 1 + 2^-23 plus a product just under 2^-24: the float64 sum is the float32 midpoint, which rounded
    # again goes to even (1 + 2^-22); the FMA's single rounding stays at 1 + 2^-23.
    j = 3
    left = torch.tensor([[1 + 2.0**-23, 2.0**-12 * (1 - j * 2.0**-23)]])
    right = torch.tensor([[1.0], [2.0**-12 * (1 + j * 2.0**-23)]])
    want = (left @ right).numpy()[:, 0]
    assert want[0] == np.float32(1 + 2.0**-23)
    got = torch_sum.summed(left.numpy(), right.numpy().T, fused=True)
    assert got.view(np.uint32).tolist() == want.view(np.uint32).tolist()


def test_the_product_is_torch_matmul_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    for r in (1, 4, 16, 64):
        b, a = _wide_range(g, 40, r), _wide_range(g, r, 30)
        want = (b @ a).numpy()
        got = torch_sum.merged(b.numpy(), a.numpy(), np.zeros((40, 30)), lambda p, _: p.copy(), fused=True)
        assert (got.view(np.uint32) == want.view(np.uint32)).all(), r


def test_a_bf16_merge_resums_only_where_the_bracket_is_ambiguous(monkeypatch):
    g = torch.Generator().manual_seed(1)
    bf = np.dtype(ml_dtypes.bfloat16)
    w = torch.randn(64, 256, generator=g).bfloat16()
    b, a = torch.randn(64, 16, generator=g) * 0.05, torch.randn(16, 256, generator=g) * 0.05
    want = w.clone()
    want += b @ a * 2.0  # PEFT's Linear.merge: a float32 delta added in place to a bf16 base
    calls = []
    real = torch_sum.summed

    def counted(x: np.ndarray, y: np.ndarray, *, fused: bool) -> np.ndarray:
        calls.append(len(x))
        return real(x, y, fused=fused)

    def finish(p: np.ndarray, w: np.ndarray) -> np.ndarray:
        return np.add(w.astype(np.float32), p * np.float32(2.0)).astype(bf)

    monkeypatch.setattr(torch_sum, "summed", counted)
    got = torch_sum.merged(b.numpy(), a.numpy(), w.float().numpy().astype(bf), finish, fused=True)
    assert (got.view(np.uint16) == want.view(torch.int16).numpy().view(np.uint16)).all()
    assert sum(calls) < w.numel() // 100  # most elements settled by BLAS's product and the bound
