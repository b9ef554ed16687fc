"""stagerd: take checkpoint export off the GPU's critical path."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LoadedStep", "SaveHandle", "Stager", "__version__"]

if TYPE_CHECKING:
    from stagerd.training.stager import LoadedStep, SaveHandle, Stager


def __getattr__(name: str) -> Any:
    # Lazy: `import stagerd` (the daemon, the CLI) must not pay for importing torch.
    if name in ("Stager", "SaveHandle", "LoadedStep"):
        try:
            from stagerd.training import stager as stage
        except ModuleNotFoundError as e:
            if e.name != "torch":
                raise
            # The daemon's install has no torch on purpose; say what the training side needs.
            raise ModuleNotFoundError(
                "stagerd.Stager and the demo need torch, which is not installed: "
                "pip install 'stagerd[train]'",
                name="torch",
            ) from None
        return getattr(stage, name)
    raise AttributeError(f"module 'stagerd' has no attribute {name!r}")
