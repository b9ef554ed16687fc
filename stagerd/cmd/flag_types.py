"""The `type=` of flags whose values have more than one spelling: argparse then stores the one the
settings and a save's marker use, and names every accepted spelling when one is wrong."""

from __future__ import annotations

import argparse

from stagerd.contract.dtypes import normalise_export_dtype
from stagerd.errors import DTypeError


def export_dtype(spec: str) -> str:
    """`--dtype bfloat16` -> `bf16`, as `STAGERD_DTYPE` and the TOML key are stored."""
    try:
        return normalise_export_dtype(spec)
    except DTypeError as e:
        raise argparse.ArgumentTypeError(e.message) from None
