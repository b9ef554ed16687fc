"""FileSystemWriter records of every dtype torch has, read in place (engine/adopt/torch_record.py).

torch pickles a dtype without a typed storage class (fp8, uint16/32/64) with `_rebuild_tensor_v3` and an
`UntypedStorage` counted in bytes. Before: `DcpFormatError: refusing to unpickle
torch._utils._rebuild_tensor_v3`, so an adopted checkpoint holding one fp8 or uint16 tensor never exported.
"""

from __future__ import annotations

import io
import os

import torch
from safetensors.torch import load_file

from stagerd.contract import dtypes
from stagerd.engine.adopt.export import export_adopted
from stagerd.engine.adopt.source import AdoptOptions
from stagerd.engine.adopt.torch_record import read_record

TORCH_DTYPES = [d for d in dtypes.DTYPES.values() if d.torch_name is not None]


def _tensor(d: dtypes.DType) -> torch.Tensor:
    """4x3 values of `d`, contiguous at storage offset 3 (as a slice of a bigger tensor)."""
    wide = torch.arange(20, dtype=torch.int32) * (1 if d.name.startswith("U") or d.name == "BOOL" else -1)
    return wide.to(getattr(torch, d.torch_name))[3:15].reshape(4, 3)


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_every_dtype_is_read_in_place(tmp_path):
    path = tmp_path / "records"
    with open(path, "wb") as f:
        places = []
        for d in TORCH_DTYPES:
            buf = io.BytesIO()
            torch.save(_tensor(d), buf)
            places.append((d, f.tell(), len(buf.getvalue())))
            f.write(buf.getvalue() + b"\0" * 5)  # records at unaligned offsets, as in a .distcp file
    fd = os.open(path, os.O_RDONLY)
    try:
        for d, base, length in places:
            r = read_record(fd, base, length, path)
            want = _tensor(d)
            assert (r.dtype, r.shape) == (d.name, tuple(want.shape)), d.name
            assert os.pread(fd, r.nbytes, r.begin) == _raw(want), d.name
    finally:
        os.close(fd)


def test_an_adopted_checkpoint_with_fp8_and_uint16_exports(tmp_path):
    """A real `dcp.save` with FileSystemWriter, exported by the `dcp` preset: every tensor's bytes."""
    import torch.distributed.checkpoint as dcp

    full = {
        "w8": torch.randn(6, 4).to(torch.float8_e4m3fn),
        "e8m0": torch.tensor([1.0, 2.0, 0.5]).to(torch.float8_e8m0fnu),
        "ids": torch.arange(10, dtype=torch.int32).to(torch.uint16),
        "w": torch.randn(3, 4),
    }
    ckpt = tmp_path / "step-3"
    dcp.save({f"model.{k}": v for k, v in full.items()}, storage_writer=dcp.FileSystemWriter(ckpt))
    export_adopted(ckpt, tmp_path / "work", AdoptOptions(preset="dcp"), step=3)
    got = {}
    for f in (tmp_path / "work" / "export").glob("*.safetensors"):
        got.update(load_file(f))
    assert sorted(got) == sorted(full)
    for k, v in full.items():
        assert got[k].dtype == v.dtype and _raw(got[k]) == _raw(v), k
