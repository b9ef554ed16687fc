"""stagerd: take checkpoint export off the GPU's critical path."""

__version__ = "0.1.0"
