"""An optimizer with schedule-free's train and eval modes, for the tests (`schedulefree` is not a
dependency): each mode switch writes the parameters in place, outside any optimizer step."""

from __future__ import annotations

from typing import Any

import torch


class ScheduleFreeSGD(torch.optim.Optimizer):
    """SGD on z; the parameters hold y (training) or x (evaluation), switched in place by `train`/`eval`
    as schedule-free's optimizers switch them."""

    def __init__(self, params: Any, lr: float = 1e-2, beta: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "beta": beta, "train_mode": True})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:  # Lightning runs the forward and backward in it
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["z"] = p.clone()
                    state["x"] = p.clone()
                state["z"].add_(p.grad, alpha=-group["lr"])
                state["x"].lerp_(state["z"], 0.5)
                p.copy_(state["x"].lerp(state["z"], 1 - group["beta"]))
        return loss

    @torch.no_grad()
    def _switch(self, train: bool) -> None:
        for group in self.param_groups:
            if group["train_mode"] != train:
                for p in group["params"]:
                    if self.state[p]:
                        p.copy_(self.state[p]["x"].lerp(self.state[p]["z"], 1 - group["beta"]) if train
                                else self.state[p]["x"])  # fmt: skip
                group["train_mode"] = train

    def train(self) -> None:
        self._switch(True)

    def eval(self) -> None:
        self._switch(False)
