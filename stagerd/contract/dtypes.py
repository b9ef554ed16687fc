"""The dtype table (safetensors names, sizes, castable or not) and every spelling of an export dtype.

No torch here: `torch_name` is a plain string, so the daemon's side reads the table without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from stagerd.errors import DTypeError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DType:
    """One safetensors dtype. `bits` is per element; F4 and F6 pack below a byte."""

    name: str
    bits: int
    castable: bool  # an IEEE float that --dtype may cast; fp8, fp4, fp6, ints, bool, complex never change
    torch_name: str | None  # attribute of the torch module, None where torch has no such dtype

    def nbytes(self, numel: int) -> int:
        """Bytes taken by `numel` elements; a sub-byte count that does not fill whole bytes is an error."""
        total = numel * self.bits
        if total % 8:
            raise DTypeError(f"{numel} elements of {self.name} do not fill whole bytes")
        return total // 8


_TABLE = (
    DType("BOOL", 8, False, "bool"),
    DType("U8", 8, False, "uint8"),
    DType("I8", 8, False, "int8"),
    DType("U16", 16, False, "uint16"),
    DType("I16", 16, False, "int16"),
    DType("U32", 32, False, "uint32"),
    DType("I32", 32, False, "int32"),
    DType("U64", 64, False, "uint64"),
    DType("I64", 64, False, "int64"),
    DType("F16", 16, True, "float16"),
    DType("BF16", 16, True, "bfloat16"),
    DType("F32", 32, True, "float32"),
    DType("F64", 64, True, "float64"),
    DType("C64", 64, False, "complex64"),
    DType("F8_E4M3", 8, False, "float8_e4m3fn"),
    DType("F8_E5M2", 8, False, "float8_e5m2"),
    DType("F8_E4M3FNUZ", 8, False, "float8_e4m3fnuz"),
    DType("F8_E5M2FNUZ", 8, False, "float8_e5m2fnuz"),
    DType("F8_E8M0", 8, False, "float8_e8m0fnu"),
    DType("F6_E2M3", 6, False, None),
    DType("F6_E3M2", 6, False, None),
    DType("F4", 4, False, None),
)
DTYPES: dict[str, DType] = {d.name: d for d in _TABLE}

# safetensors' `Dtype` enum in declaration order. Its writer lays a file out in descending enum order, then
# by name (code point order), which also keeps every tensor aligned to its element size; an export whose
# files are to be the bytes `save_pretrained` writes uses the same order (`writer_rank`).
_WRITER_ENUM = (
    "BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ",
    "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64",
)  # fmt: skip
_WRITER_RANK = {name: i for i, name in enumerate(_WRITER_ENUM)}


def writer_rank(name: str) -> int:
    """The place of a dtype in safetensors' `Dtype` enum: its writer puts higher ranks first."""
    return _WRITER_RANK[name]


# --dtype spellings -> safetensors name; "keep" maps to None. Besides the short forms, torch's and
# transformers' names (`torch_dtype="bfloat16"`, `torch.half`, `torch.float`), as users write them there.
EXPORT_DTYPES: dict[str, str | None] = {
    "keep": None,
    "bf16": "BF16",
    "bfloat16": "BF16",
    "fp16": "F16",
    "f16": "F16",
    "float16": "F16",
    "half": "F16",
    "fp32": "F32",
    "f32": "F32",
    "float32": "F32",
    "float": "F32",
}


# The spellings offered to users (CLI choices, settings, the marker's hint), short form first.
EXPORT_DTYPE_CHOICES = ("keep", "bf16", "fp16", "fp32")
EXPORT_DTYPE_TEXT = "keep|bf16|fp16|fp32 (or bfloat16, float16, half, float32, float)"


def export_dtype_hint(name: str | None) -> str:
    """The short spelling of a cast target, for a marker's hint: `BF16` -> `bf16`, None -> `keep`."""
    for spelling in EXPORT_DTYPE_CHOICES:
        if EXPORT_DTYPES[spelling] == name:
            return spelling
    raise DTypeError(f"{name!r} is not an export dtype; use one of {', '.join(EXPORT_DTYPE_CHOICES)}")


def lookup(name: str, *, path: object = None) -> DType:
    """The DType for a safetensors dtype name; an unknown name is a DTypeError."""
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise DTypeError(f"unknown safetensors dtype {name!r}", path=path) from None


def parse_export_dtype(spec: str | None) -> str | None:
    """`bf16`, `bfloat16` -> `BF16`, `keep`/None -> None, in any case. An unknown spelling is a DTypeError."""
    if spec is None:
        return None
    try:
        return EXPORT_DTYPES[spec.lower()]
    except (KeyError, AttributeError):
        raise DTypeError(f"unknown export dtype {spec!r}; use one of {EXPORT_DTYPE_TEXT}") from None


def normalise_export_dtype(spec: str) -> str:
    """Any spelling of an export dtype -> its short one (`BFloat16`, `half` -> `bf16`, `fp16`): what
    settings, flags and a save's dtype store. An unknown spelling is a DTypeError."""
    return export_dtype_hint(parse_export_dtype(spec))


def safetensors_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype (`torch.bfloat16` -> `BF16`)."""
    short = str(dtype).removeprefix("torch.")
    for d in _TABLE:
        if d.torch_name == short:
            return d.name
    raise DTypeError(f"torch dtype {dtype} has no safetensors name")
