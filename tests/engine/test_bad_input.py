"""Each bad input ends with a named error, a non-zero exit, one line naming the file, and no output."""

from __future__ import annotations

import json
import os
import struct
import subprocess
from pathlib import Path

import pytest

from stagerd.contract import commit_marker, layout
from stagerd.engine.export import export_step
from stagerd.errors import DTypeError, HeaderError, PlanError, ShardError
from tests.cli_helpers import run_cli


def first_shard(step: Path) -> Path:
    return sorted((step / "model").glob("*.safetensors"))[0]


def rewrite_header(path: Path, edit) -> None:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    body = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n :])


def recommit(step: Path) -> None:
    """Refresh the marker's sizes so only the damage under test is wrong."""
    m = commit_marker.read_marker(step)
    files = tuple(commit_marker.StagedFile(f.path, (step / f.path).stat().st_size) for f in m.files)
    commit_marker.write_marker(step, commit_marker.CommitMarker(**{**m.__dict__, "files": files}))


def truncate(step: Path) -> None:
    p = first_shard(step)
    p.write_bytes(p.read_bytes()[:-10])


def truncate_and_recommit(step: Path) -> None:
    truncate(step)
    recommit(step)


def absurd_length(step: Path) -> None:
    p = first_shard(step)
    raw = p.read_bytes()
    p.write_bytes(struct.pack("<Q", 2**62) + raw[8:])


def overlap(step: Path) -> None:
    def edit(h):
        names = [k for k in h if k != "__metadata__"]
        h[names[1]]["data_offsets"] = list(h[names[0]]["data_offsets"])
        h[names[1]]["dtype"], h[names[1]]["shape"] = h[names[0]]["dtype"], h[names[0]]["shape"]

    rewrite_header(first_shard(step), edit)
    recommit(step)


def past_end(step: Path) -> None:
    def edit(h):
        name = next(k for k in h if k != "__metadata__")
        b, e = h[name]["data_offsets"]
        h[name]["data_offsets"] = [b + 10**6, e + 10**6]

    rewrite_header(first_shard(step), edit)
    recommit(step)


def empty_shape_overflows(step: Path) -> None:
    """No elements, but dims before the 0 that multiply past 64 bits: safetensors' loader refuses it."""

    def edit(h):
        name = next(k for k in h if k != "__metadata__")
        b, _ = h[name]["data_offsets"]
        h[name]["shape"], h[name]["data_offsets"] = [2**40, 2**40, 0], [b, b]

    rewrite_header(first_shard(step), edit)
    recommit(step)


def missing_shard(step: Path) -> None:
    first_shard(step).unlink()


def missing_dcp_metadata(step: Path) -> None:
    rewrite_header(first_shard(step), lambda h: h["__metadata__"].pop("DCP_SHARDING_INFO"))
    recommit(step)


def unknown_dtype(step: Path) -> None:
    def edit(h):
        name = next(k for k in h if k != "__metadata__")
        h[name]["dtype"] = "F12"

    rewrite_header(first_shard(step), edit)
    recommit(step)


def missing_trailing_shard(step: Path) -> None:
    """Drop the last rank's file from disk and marker: headers alone would give smaller tensors."""
    last = sorted((step / "model").glob("*.safetensors"))[-1]
    last.unlink()
    m = commit_marker.read_marker(step)
    files = tuple(f for f in m.files if not f.path.endswith(last.name))
    commit_marker.write_marker(step, commit_marker.CommitMarker(**{**m.__dict__, "files": files}))


CASES = [
    (truncate, ShardError, "truncated"),
    (truncate_and_recommit, HeaderError, "truncated"),
    (absurd_length, HeaderError, "header length"),
    (overlap, HeaderError, "overlap"),
    (past_end, HeaderError, "run past"),
    (empty_shape_overflows, HeaderError, "overflows 64 bits"),
    (missing_shard, ShardError, "missing"),
    (missing_dcp_metadata, HeaderError, "DCP_SHARDING_INFO"),
    (unknown_dtype, DTypeError, "F12"),
    (missing_trailing_shard, PlanError, "missing"),
]


@pytest.mark.parametrize(("damage", "error", "words"), CASES, ids=[c[0].__name__ for c in CASES])
def test_bad_step_is_a_named_error_and_leaves_no_export(step_dir, damage, error, words):
    damage(step_dir)
    with pytest.raises(error, match=words) as info:
        export_step(step_dir)
    assert info.value.path  # names the file
    assert not (step_dir / layout.EXPORT_DIR).exists()
    assert not (step_dir / layout.EXPORT_TMP_DIR).exists()
    assert (step_dir / "model").is_dir()  # staged data untouched


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(args)


def _memory_cap() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


@pytest.mark.parametrize(("damage", "error", "words"), CASES[:4], ids=[c[0].__name__ for c in CASES[:4]])
def test_cli_prints_one_line_and_leaves_no_output(step_dir, tmp_path, damage, error, words):
    damage(step_dir)
    out = tmp_path / "out"
    r = _cli("consolidate", str(step_dir), str(out))
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("stagerd:")]
    assert len(lines) == 1 and error.__name__ in lines[0] and str(step_dir) in lines[0]
    assert "what to do" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_cli_debug_shows_the_traceback(step_dir, tmp_path):
    truncate(step_dir)
    r = _cli("--debug", "consolidate", str(step_dir), str(tmp_path / "out"))
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_raw_shard_dir_with_a_gap_is_a_missing_shard(dcp_mixed, tmp_path):
    import shutil

    src, _ = dcp_mixed
    shutil.copytree(src, tmp_path / "model")
    sorted((tmp_path / "model").glob("shard-00002-*"))[0].unlink()
    r = _cli("consolidate", str(tmp_path / "model"), str(tmp_path / "out"))
    assert r.returncode != 0 and "ShardError" in r.stderr and "[2]" in r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "number, words",
    [("99999999999999", "[1, 2, 3, 4, 5] are missing"), ("00000", "number 0"), ("\u0661", "unexpected file")],
)
def test_a_shard_number_that_no_rank_writes_is_refused_at_once(tmp_path, number, words):
    """Before: the gap check built a set of every number up to the largest, so one file named
    shard-99999999999999-... held `consolidate` for good growing toward 10^14 ints; shard 0 (DCP numbers
    from 1) and other scripts' digits (`\\d` matched U+0661) were taken as ranks."""
    from stagerd.contract.safetensors_format import encode_header

    src = tmp_path / "src"
    src.mkdir()
    info = json.dumps({"w": {"saved_offsets": [0]}})
    head = encode_header({"w": ("F32", (1,), 0, 4)}, {"DCP_SHARDING_INFO": info, "format": "pt"})
    (src / f"shard-{number}-model-00001-of-00001.safetensors").write_bytes(head + bytes(4))
    r = run_cli(["consolidate", src, tmp_path / "out"], preexec=_memory_cap)  # MemoryError, not a swap storm
    assert r.returncode == 2 and "ShardError" in r.stderr and words in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_non_writable_out(step_dir, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    r = _cli("consolidate", str(step_dir), str(blocker / "out"))
    assert r.returncode == 2 and "ConfigError" in r.stderr and "is a file, not a directory" in r.stderr


def test_marker_listing_outside_the_step_is_refused(step_dir):
    from stagerd.errors import MarkerError

    m = commit_marker.read_marker(step_dir)
    files = (*m.files, commit_marker.StagedFile("../../etc/passwd", 10))
    raw = m.to_json() | {"files": [f.__dict__ for f in files]}
    (step_dir / layout.MARKER_NAME).write_text(json.dumps(raw))
    with pytest.raises(MarkerError, match="escapes"):
        export_step(step_dir)


def test_symlinked_shard_pointing_outside_is_refused(step_dir, tmp_path):
    from stagerd.errors import MarkerError

    victim = first_shard(step_dir)
    outside = tmp_path / "outside.safetensors"
    victim.rename(outside)
    victim.symlink_to(outside)
    with pytest.raises(MarkerError, match="outside"):
        export_step(step_dir)


def test_an_empty_tensor_whose_blocks_add_up_past_64_bits_is_refused(tmp_path):
    """Each rank's block of no elements has a shape safetensors loads; the tensor they make, [2**32, 2**32,
    0], it refuses ("overflow computing buffer size"): a PlanError before anything is written, not an
    export that verify called good and no loader can open."""
    from stagerd.contract.safetensors_format import encode_header
    from stagerd.engine.consolidate import consolidate_into

    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    for r in range(2):
        entries = {"w": ("F32", (2**31, 2**32, 0), 0, 0), "b": ("F32", (1,), 0, 4)}
        info = {"w": {"saved_offsets": [r * 2**31, 0, 0]}, "b": {"saved_offsets": [0] if r == 0 else [1]}}
        head = encode_header(entries, {"DCP_SHARDING_INFO": json.dumps(info), "format": "pt"})
        (src / f"shard-{r + 1:05d}-model-00001-of-00001.safetensors").write_bytes(head + bytes(4))
    with pytest.raises(PlanError, match=r"'w': shape \[4294967296, 4294967296, 0\] overflows 64 bits") as e:
        consolidate_into(src, out)
    assert not e.value.retryable and "\n" not in str(e.value)
    assert list(out.iterdir()) == []


def _two_file_export(tmp_path: Path) -> Path:
    """An export of two one-tensor files, consolidated from a one-rank step: its index to damage."""
    from stagerd.contract.safetensors_format import encode_header

    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    info = json.dumps({"w": {"saved_offsets": [0]}, "b": {"saved_offsets": [0]}})
    head = encode_header({"w": ("F32", (2,), 0, 8), "b": ("F32", (2,), 8, 16)}, {"DCP_SHARDING_INFO": info})
    (src / "shard-00001-model-00001-of-00001.safetensors").write_bytes(head + bytes(16))
    assert _cli("consolidate", str(src), str(out), "--max-shard-size", "8").returncode == 0
    return out


@pytest.mark.parametrize("fname", ["a\x00b", "", "..", ".hidden", "sub/x.safetensors"])
def test_an_index_naming_a_file_no_export_can_hold_is_a_verify_error(tmp_path, fname):
    """Before: a NUL in the index's file name reached os.open as a raw ValueError (a traceback, exit 1)."""
    out = _two_file_export(tmp_path)
    index = json.loads((out / layout.INDEX_NAME).read_text())
    index["weight_map"]["w"] = fname
    (out / layout.INDEX_NAME).write_text(json.dumps(index))
    r = _cli("verify", str(out))
    assert r.returncode == 2 and "VerifyError" in r.stderr and "unsafe file name" in r.stderr, r.stderr


@pytest.mark.parametrize("index", ["fifo", "huge"])
def test_verify_of_an_index_that_is_a_fifo_or_huge_is_a_verify_error_at_once(tmp_path, index):
    """Before: verify of an export whose index was a FIFO waited for a writer for good, and one whose index
    was a sparse 1 TiB file read it whole (MemoryError)."""
    out = _two_file_export(tmp_path)
    (out / layout.INDEX_NAME).unlink()
    if index == "fifo":
        os.mkfifo(out / layout.INDEX_NAME)
    else:
        with open(out / layout.INDEX_NAME, "wb") as f:
            f.truncate(1 << 40)
    r = run_cli(["verify", out], timeout=60, preexec=_memory_cap)
    assert r.returncode == 2 and "VerifyError" in r.stderr, r.stderr
    assert ("not a regular file" if index == "fifo" else "larger than 64 MiB") in r.stderr
