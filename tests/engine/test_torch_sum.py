"""engine/torch_sum.py sums a LoRA product B @ A as torch's CPU matmul does, bit for bit: along the rank
in order, each step a fused multiply-add rounded once, where numpy's matmul sums in an order of its own.
Both paths: the C sums of `_torchsum.c` where it was built, numpy's float64 emulation without it."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from stagerd.engine import torch_sum


@pytest.fixture(params=[True, False], ids=["c", "numpy"])
def compiled(request, monkeypatch) -> bool:
    """The C sums (skipped where the extension is not built), or numpy's with the module taken away."""
    if not request.param:
        monkeypatch.setattr(torch_sum, "_torchsum", None)
    elif torch_sum._torchsum is None:
        pytest.skip("the _torchsum extension is not built")
    return request.param


def _wide_range(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-20, 20, shape, generator=g).float())


def test_each_rank_step_is_rounded_once_as_an_fma_rounds_it(compiled):
    # 1 + 2^-23 plus a product just under 2^-24: the float64 sum is the float32 midpoint, which rounded
    # again goes to even (1 + 2^-22); the FMA's single rounding stays at 1 + 2^-23.
    # The case sits in a 16 x 16 product: a narrower one goes through the BLAS's small-matrix kernels,
    # whose order depends on the CPU (MKL on AMD rounds each product first below 16 columns).
    j = 3
    g = torch.Generator().manual_seed(0)
    left, right = torch.randn(16, 2, generator=g), torch.randn(2, 16, generator=g)
    left[0] = torch.tensor([1 + 2.0**-23, 2.0**-12 * (1 - j * 2.0**-23)])
    right[:, 0] = torch.tensor([1.0, 2.0**-12 * (1 + j * 2.0**-23)])
    want = (left @ right).numpy()
    assert want[0, 0] == np.float32(1 + 2.0**-23)
    got = torch_sum.summed(left.numpy()[:1], right.numpy().T[:1], fused=True)
    assert got.view(np.uint32).tolist() == want[:1, 0].view(np.uint32).tolist()


def test_the_product_is_torch_matmul_bit_for_bit(compiled):
    g = torch.Generator().manual_seed(0)
    for r in (1, 4, 16, 64):
        b, a = _wide_range(g, 40, r), _wide_range(g, r, 30)
        want = (b @ a).numpy()
        got = torch_sum.merged(b.numpy(), a.numpy(), np.zeros((40, 30)), lambda p, _: p.copy(), fused=True)
        assert (got.view(np.uint32) == want.view(np.uint32)).all(), r


def test_a_bf16_merge_resums_only_where_the_bracket_is_ambiguous(monkeypatch, compiled):
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
    # most elements settled by BLAS's product and the bound; the C path sums every one, none re-summed
    assert sum(calls) < w.numel() // 100 if not compiled else sum(calls) == 0


def test_subnormal_sums_are_torch_matmul_bit_for_bit(compiled):
    # products and partial sums below float32's least normal, 2^-126, where its ulp is fixed at 2^-149
    g = torch.Generator().manual_seed(2)
    scale = torch.exp2(torch.randint(-80, -60, (50, 8), generator=g).float())
    b, a = torch.randn(50, 8, generator=g) * scale, torch.randn(8, 20, generator=g) * 2.0**-66
    want = (b @ a).numpy()
    assert (np.abs(want[want != 0]) < 2.0**-126).mean() > 0.5
    got = torch_sum.merged(b.numpy(), a.numpy(), np.zeros((50, 20)), lambda p, _: p.copy(), fused=True)
    assert (got.view(np.uint32) == want.view(np.uint32)).all()


@pytest.mark.skipif(torch_sum._torchsum is None, reason="the _torchsum extension is not built")
@pytest.mark.parametrize("fused", [True, False])
def test_the_c_sums_are_the_numpy_sums_bit_for_bit(monkeypatch, fused):
    g = torch.Generator().manual_seed(3)
    for r in (1, 3, 16, 33):
        # wide exponents, subnormal products among them, and the cancellations of mixed signs
        x = _wide_range(g, 4000, r) * torch.exp2(torch.randint(-70, 0, (4000, r), generator=g).float())
        x = x.numpy()
        y = _wide_range(g, 4000, r).numpy()
        c = torch_sum.summed(x, y, fused=fused)
        left, right = x[:40], _wide_range(g, r, 100).numpy()
        block = torch_sum.merged(left, right, np.zeros((40, 100)), lambda p, _: p.copy(), fused=fused)
        monkeypatch.setattr(torch_sum, "_torchsum", None)
        assert (c.view(np.uint32) == torch_sum.summed(x, y, fused=fused).view(np.uint32)).all(), r
        want = torch_sum.merged(left, right, np.zeros((40, 100)), lambda p, _: p.copy(), fused=fused)
        assert (block.view(np.uint32) == want.view(np.uint32)).all(), r
        if fused:  # PEFT's merge: torch's CPU matmul of float32 [m, r] @ [r, n]
            mm = (torch.from_numpy(left) @ torch.from_numpy(right)).numpy()
            assert (block.view(np.uint32) == mm.view(np.uint32)).all(), r
        monkeypatch.undo()


@pytest.mark.skipif(torch_sum._torchsum is None, reason="the _torchsum extension is not built")
def test_the_c_sums_check_their_buffers():
    f = np.zeros(12, dtype=np.float32)
    torch_sum._torchsum.block(f[:6], f[:8], np.zeros(12, dtype=np.float32), 3, 2, 4, True)  # fits
    with pytest.raises(ValueError, match="do not hold"):
        torch_sum._torchsum.block(f[:6], f[:8], np.zeros(11, dtype=np.float32), 3, 2, 4, True)
    with pytest.raises(ValueError, match="do not hold"):
        torch_sum._torchsum.rows(f[:6], f[:6], np.zeros(3, dtype=np.float32), 3, -2, False)
