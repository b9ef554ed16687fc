"""stagerd: take checkpoint export off the GPU's critical path."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["SaveHandle", "Stager", "__version__"]

if TYPE_CHECKING:
    from stagerd.training.stager import SaveHandle, Stager


def __getattr__(name: str) -> Any:
    # Lazy: `import stagerd` (the daemon, the CLI) must not pay for importing torch.
    if name in ("Stager", "SaveHandle"):
        from stagerd.training import stager as stage

        return getattr(stage, name)
    raise AttributeError(f"module 'stagerd' has no attribute {name!r}")
