"""Kept so that `from stagerd.stage import Stager`, as older READMEs wrote it, still works."""

from stagerd.training.stager import SaveHandle, Stager

__all__ = ["SaveHandle", "Stager"]
