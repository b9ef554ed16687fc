"""The part of a LightningModule's state dict that is the exported model, staged under that model's own
names.

`Stager.save(model=...)` plans the export from keys that are the model's own (a PEFT model's plan reads
PEFT's names), so where the model to export is a part of the module, a PEFT model inside it or the
submodule given as `model=`, the plugin stages that part with its prefix taken off (the keys
`peft_model.state_dict()` gives, as a loop of one's own saves them) and the module's other tensors
beside the optimizer state; `module_part.joined` puts the module's state dict back together on load. A module
that holds a plain transformers model needs no part: the export finds that model under its prefix.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from stagerd.training.config_model import inside_compile

OUTSIDE = "stagerd/lightning_module"  # the optim/ prefix of the module's tensors outside the part


@dataclass(frozen=True)
class Part:
    model: Any  # what the export is planned from
    prefix: str  # its keys' prefix in the module's state dict ("model.")

    def split(
        self, sd: Mapping[str, torch.Tensor], aliases: Mapping[str, str]
    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """The part's state dict (every key under the prefix, without it; the Stager stages a tied tensor
        once) and, for each other tensor of the module (not a tied duplicate), its name in optim/."""
        p = self.prefix
        inner = {k[len(p) :]: v for k, v in sd.items() if k.startswith(p)}
        outside = {k: f"{OUTSIDE}/{k}" for k in sd if not k.startswith(p) and k not in aliases}
        return inner, outside

    def to_json(self, outside: Mapping[str, str]) -> dict[str, Any]:
        return {"prefix": self.prefix, "outside": dict(outside)}


def joined(
    blob: Mapping[str, Any], model: Mapping[str, torch.Tensor], optim: Callable[[str], torch.Tensor]
) -> Callable[[str], torch.Tensor]:
    """The tensor of a staged key (a key of the module's state dict that is no tied duplicate), where the
    save put it: the part's in model/ under its own name, the module's others in optim/."""
    part = blob.get("part")
    if not isinstance(part, Mapping):
        return model.__getitem__
    prefix, outside = str(part["prefix"]), dict(part["outside"])

    def tensor(key: str) -> torch.Tensor:
        return optim(outside[key]) if key in outside else model[key[len(prefix) :]]

    return tensor


def find(given: Any, module: Any) -> Part | None:
    """The part of `module` (the LightningModule) to stage apart: `given` where it is a submodule of it,
    else the one outermost PEFT model inside `module`; None: stage the module's state dict as it is."""
    if module is None or not isinstance(module, torch.nn.Module):
        return None
    if inside_compile(given) is module:  # `torch.compile(module)` given, the module itself fitted
        given = module
    if given is not None and given is not module:
        name = next((n for n, m in module.named_modules() if m is given and n), None)
        if name is None:
            return None
        while inside_compile(given) is not None:  # the part's keys carry the compiled wrapper's `_orig_mod.`
            given, name = inside_compile(given), f"{name}._orig_mod"
        return Part(given, f"{name}.")
    peft = sys.modules.get("peft")
    if peft is None or given is None:
        return None
    found = [(n, m) for n, m in module.named_modules() if n and isinstance(m, peft.PeftModel)]
    outer = [(n, m) for n, m in found if not any(n.startswith(f"{o}.") for o, _ in found)]
    if len(outer) != 1:
        return None
    name, peft_model = outer[0]
    return Part(peft_model, f"{name}.")
