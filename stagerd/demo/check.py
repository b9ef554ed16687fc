"""Phase 3 of the demo: every published step loads with safetensors and equals the trained weights."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stagerd.contract import layout
from stagerd.demo.fetch import published_copy
from stagerd.demo.plan import DemoPlan, DemoResult
from stagerd.engine.export_map import read_weight_map
from stagerd.errors import VerifyError
from stagerd.ops.progress import progress

if TYPE_CHECKING:
    import torch


def check(plan: DemoPlan, result: DemoResult) -> None:
    """Compare every step's published copy with `expected/`, byte for byte; a difference is a VerifyError."""
    with progress("check against the trained weights", plan.steps, unit="steps") as bar:
        for step in range(1, plan.steps + 1):
            _check_step(plan, result, step)
            bar(step, plan.steps)


def _check_step(plan: DemoPlan, result: DemoResult, step: int) -> None:
    from safetensors import safe_open

    where, label = published_copy(plan, step)
    weight_map, _ = read_weight_map(where)
    expected_file = plan.expected / f"{layout.step_dir_name(step)}.safetensors"
    with safe_open(str(expected_file), framework="pt") as exp:
        names = set(exp.keys())
        if set(weight_map) != names:
            diff = sorted(names ^ set(weight_map))
            raise VerifyError(f"step {step}: the export's tensors differ from training's: {diff}", path=where)
        for name in sorted(names):
            with safe_open(str(where / weight_map[name]), framework="pt") as got:
                if not _bit_equal(got.get_tensor(name), exp.get_tensor(name)):
                    raise VerifyError(f"step {step}: {name} differs from the trained weights", path=where)
    result.checked[step] = label
    result.tensors = len(names)


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )
