"""A DCP-format `optim/` (a step saved by an earlier stagerd) whose pickles nest too deep: its `.metadata`,
a tensor's record and a value's record are each refused by name before anything unpickles them, where
before the trainer died (SIGSEGV: CPython hashes a deep tuple key by recursing in C); a normal 2-rank
`.metadata` still loads."""

from __future__ import annotations

import io
import pickle
import re
import struct
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo

from stagerd.errors import LoadError
from stagerd.training.failures import describe
from stagerd.training.safe_metadata import SafeFileSystemReader, SafeLoadPlanner, read_dcp_metadata
from tests.training.optim_metadata import optim_metadata

# A dict keyed by a tuple nested a million deep: no global, so the allowlist never sees it.
DEEP = b"\x80\x04}" + b")" + b"\x85" * 1_000_000 + b"K\x01s."


def _one_line(e: LoadError) -> None:
    assert "\n" not in str(e) and e.hint and e.path


def test_a_deep_optim_metadata_is_refused_by_name_before_it_is_unpickled(tmp_path):
    (tmp_path / ".metadata").write_bytes(DEEP)
    with pytest.raises(LoadError, match="refusing DCP metadata that nests values more than 100 deep") as e:
        SafeFileSystemReader(str(tmp_path)).read_metadata()
    assert e.value.path == str(tmp_path / ".metadata")
    _one_line(e.value)
    with pytest.raises(LoadError, match="unreadable: malformed pickle: it ends before its STOP"):
        read_dcp_metadata(b"\x80\x04}q\x00(X\x01\x00\x00\x00a", "optim/.metadata")


def _records_grown_inside(hops: int) -> bytes:
    """`hops` MetadataIndex records, each nested 95 deep in a tuple, then each given (by BUILD) the tuple of
    the one before as its fqn: every depth a scan of values as they are built sees stays under 100, but
    hashing the last tuple recurses through all of them (a frozen dataclass hashes its fields)."""
    put, get = (lambda i: b"r" + struct.pack("<I", i)), (lambda i: b"j" + struct.pack("<I", i))
    out = [b"\x80\x04ctorch.distributed.checkpoint.metadata\nMetadataIndex\n", put(0), b"0"]
    out += [get(0) + b")\x81" + put(1 + i) + b"0" for i in range(hops)]
    out += [get(1 + i) + b"\x85" * 95 + put(1 + hops + i) + b"0" for i in range(hops)]
    for i in range(hops - 1):
        out += [get(2 + i), b"}(\x8c\x03fqn", get(1 + hops + i), b"\x8c\x06offsetN\x8c\x05indexNub0"]
    return b"".join([*out, b"(", get(2 * hops), b"\x91."])


def test_records_grown_after_they_were_nested_are_refused():
    """Before (and with a scan that let values grow after they were put inside another): SIGSEGV in a
    trainer whose recursion limit is raised (each hop is one Python frame; the default limit of 1,000
    stops it with RecursionError)."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(100_000)
    try:
        with pytest.raises(LoadError, match="a value grows after it was put inside another"):
            read_dcp_metadata(_records_grown_inside(5_000), "optim/.metadata")
    finally:
        sys.setrecursionlimit(limit)


def test_a_two_rank_optim_metadata_still_loads(tmp_path):
    want = optim_metadata(512, ranks=2)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(want))
    got = SafeFileSystemReader(str(tmp_path)).read_metadata()
    assert got.state_dict_metadata == want.state_dict_metadata
    assert got.storage_data == want.storage_data and got.planner_data == want.planner_data


def _with_pickle(record: bytes, pkl: bytes) -> bytes:
    """A torch.save archive with its data.pkl replaced."""
    src, out = zipfile.ZipFile(io.BytesIO(record)), io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for info in src.infolist():
            z.writestr(info, pkl if info.filename.endswith("/data.pkl") else src.read(info))
    return out.getvalue()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("optim")
    dcp.save({"w": torch.arange(6.0), "lr": 0.5}, checkpoint_id=str(root), no_dist=True)
    return root


def _load(root: Path) -> dict:
    state = {"w": torch.zeros(6), "lr": 0.0}
    dcp.load(state, storage_reader=SafeFileSystemReader(str(root)), planner=SafeLoadPlanner(), no_dist=True)
    return state


@pytest.mark.parametrize(
    ("fqn", "record", "transforms", "refused"),
    [
        ("w", "deep", None, "PickleShapeError: nests values more than 100 deep"),
        ("lr", "deep", None, "PickleShapeError: nests values more than 100 deep"),
        ("lr", "legacy", None, "ValueError: not a torch.save archive"),
        ("w", "same", ["zstd"], r"ValueError: it is transformed \(zstd\)"),
    ],
)
def test_a_record_is_checked_before_torch_load_reads_it(saved, tmp_path, fqn, record, transforms, refused):
    assert _load(saved)["lr"] == 0.5  # the checkpoint as saved loads
    meta = pickle.loads((saved / ".metadata").read_bytes())  # written here: trusted
    index = next(i for i in meta.storage_data if i.fqn == fqn)
    info = meta.storage_data[index]
    with open(saved / info.relative_path, "rb") as f:
        f.seek(info.offset)
        data = f.read(info.length)
    data = {"deep": _with_pickle(data, DEEP), "legacy": DEEP, "same": data}[record]
    (tmp_path / "other.distcp").write_bytes(data)
    meta.storage_data[index] = _StorageInfo("other.distcp", 0, len(data), transforms)
    for p in saved.iterdir():
        if p.suffix == ".distcp":
            (tmp_path / p.name).write_bytes(p.read_bytes())
    (tmp_path / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(CheckpointException) as e:  # holding each rank's error
        _load(tmp_path)
    why = describe(e.value)  # as Stager.load reports it on every rank
    assert re.fullmatch(
        f"rank 0: LoadError: {tmp_path}: refusing the record at 0 of other.distcp: {refused}", why
    )


def test_the_optimizers_leaves_file_is_checked_before_torch_load_reads_it(tmp_path):
    """The Stager's own optim format keeps each rank's non-tensor leaves in `optim/shard-RRRRR.objects.pt`,
    read with `torch.load(weights_only=True)`: a replaced one whose pickle nests a key a million deep
    killed the resuming trainer (SIGSEGV). Now refused by name; the file as saved still loads."""
    import dataclasses

    from stagerd import Stager
    from stagerd.contract import commit_marker, layout
    from stagerd.errors import StagerdError

    optim = {"state": {}, "param_groups": [{"lr": 0.5}]}
    with Stager(tmp_path) as stager:
        stager.save({"w": torch.randn(3)}, 1, optimizer_state=optim).result()
        got = {"state": {}, "param_groups": [{"lr": 0.0}]}
        stager.load({"w": torch.zeros(3)}, got)
        assert got["param_groups"] == optim["param_groups"]
        step_dir = tmp_path / layout.step_dir_name(1)
        (leaves,) = step_dir.glob("optim/*.objects.pt")
        leaves.write_bytes(_with_pickle(leaves.read_bytes(), DEEP))
        marker = commit_marker.read_marker(step_dir)  # listing the new size: a replaced file, not a torn one
        files = [
            commit_marker.StagedFile(f.path, leaves.stat().st_size) if f.path.endswith(".objects.pt") else f
            for f in marker.files
        ]
        (step_dir / layout.MARKER_NAME).unlink()
        commit_marker.write_marker(step_dir, dataclasses.replace(marker, files=tuple(files)))
        with pytest.raises(StagerdError, match="refusing the optimizer's leaves: PickleShapeError: nests"):
            stager.load({"w": torch.zeros(3)}, {"state": {}, "param_groups": [{"lr": 0.0}]})
