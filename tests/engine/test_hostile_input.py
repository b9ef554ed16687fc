"""Hostile staged input on real DCP shards: names that look like paths, links and marker entries that point
outside, a FIFO where a shard should be, and a checkpoint of 20k tiny tensors.

Extends tests/test_bad_input.py (which covers `..` in a marker and a symlinked shard).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from stagerd.contract import commit_marker, layout
from stagerd.contract.dtypes import safetensors_name
from stagerd.engine.export import export_step
from stagerd.engine.verify import verify_export
from stagerd.errors import MarkerError, PlanError, ShardError
from tests.cli_helpers import run_cli
from tests.dcp_fixtures import commit_step, dcp_save
from tests.export_index import export_index

HOSTILE_NAMES = [
    "../../escape.weight",
    "a/b/c.weight",
    "/etc/passwd",
    "back\\slash\\..\\..\\x",
    "nul\x00inside",
    "\x1b[31mansi\x1b[0m",
    "new\nline\rand\ttab",
    "..",
    ".",
    "",
    "model.safetensors.index.json",  # the name of a file the export writes
    "model.safetensors",
    "é漢字🙂",
    "x" * 70_000,  # far past NAME_MAX and PATH_MAX
]


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return run_cli(args, timeout=timeout)


def _tree(root: Path) -> set[str]:
    """Every path under root, files, directories and links alike."""
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def rename_tensors(model_dir: Path, mapping: dict[str, str]) -> None:
    """Rename tensors in every shard's header and DCP_SHARDING_INFO; data sections stay as DCP wrote them."""
    for p in sorted(model_dir.glob("*.safetensors")):
        raw = p.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        meta = header.pop("__metadata__")
        info = json.loads(meta["DCP_SHARDING_INFO"])
        meta["DCP_SHARDING_INFO"] = json.dumps({mapping.get(k, k): v for k, v in info.items()})
        renamed = {"__metadata__": meta, **{mapping.get(k, k): v for k, v in header.items()}}
        body = json.dumps(renamed).encode()
        p.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n :])


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def load_all(export: Path) -> dict[str, torch.Tensor]:
    index = export_index(export)
    out = {}
    for fname in sorted(set(index["weight_map"].values())):  # one open per file: headers can be huge
        with safe_open(export / fname, "pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    assert set(out) == set(index["weight_map"])
    return out


@pytest.fixture
def hostile_step(tmp_path, dcp_mixed2) -> tuple[Path, dict[str, torch.Tensor]]:
    """A committed 2-rank step whose tensors carry HOSTILE_NAMES, and the full tensors under those names."""
    src, full = dcp_mixed2
    mapping = dict(zip(sorted(full), HOSTILE_NAMES, strict=False))
    root = tmp_path / "root"
    step = root / "step-00000005"
    shutil.copytree(src, step / "model")
    rename_tensors(step / "model", mapping)
    renamed = {mapping.get(k, k): v for k, v in full.items()}
    tensors = {
        k: commit_marker.TensorInfo(safetensors_name(v.dtype), tuple(v.shape)) for k, v in renamed.items()
    }
    commit_step(step, world=2, tensors=tensors)
    return step, renamed


def test_hostile_names_go_into_json_only_and_round_trip(hostile_step, tmp_path):
    step, want = hostile_step
    before = _tree(tmp_path)

    result = export_step(step, max_shard_size=1)  # a file per tensor: every name goes into the index too

    export = step / layout.EXPORT_DIR
    created = _tree(tmp_path) - before
    # The options file sits beside export/ (never published), so a rebuild can tell what made it.
    assert created == {str(Path("root") / step.name / layout.EXPORT_DIR / f) for f, _ in result.files} | {
        str(Path("root") / step.name / layout.EXPORT_DIR),
        str(Path("root") / step.name / layout.EXPORT_OPTIONS_NAME),
    }
    n = len(want)
    assert {f for f, _ in result.files} == {layout.INDEX_NAME} | {
        f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)
    }
    got = load_all(export)
    assert set(got) == set(want)
    for name, ref in want.items():
        assert got[name].dtype == ref.dtype and tuple(got[name].shape) == tuple(ref.shape), repr(name)
        assert _bytes(got[name]) == _bytes(ref), repr(name)
    assert verify_export(export, step).tensors == len(want)


def test_hostile_names_through_the_cli(hostile_step, tmp_path):
    step, want = hostile_step
    out = tmp_path / "out"
    before = _tree(tmp_path)

    r = _cli("consolidate", str(step), str(out))

    assert r.returncode == 0, r.stderr
    created = _tree(tmp_path) - before
    assert created == {"out", *(f"out/{f}" for f in _tree(out))}
    assert _tree(out) == {"model.safetensors"}  # one file, no index, as save_pretrained
    assert set(load_all(out)) == set(want)
    v = _cli("verify", str(out), "--against", str(step))
    assert v.returncode == 0, v.stderr


def test_hostile_names_in_an_error_stay_on_one_escaped_line(hostile_step, tmp_path):
    """A missing rank's shard names the tensors it lacks: control characters come out escaped."""
    step, _ = hostile_step
    last = sorted((step / "model").glob("*.safetensors"))[-1]
    last.unlink()
    m = commit_marker.read_marker(step)
    files = tuple(f for f in m.files if not f.path.endswith(last.name))
    commit_marker.write_marker(step, commit_marker.CommitMarker(**{**m.__dict__, "files": files}))

    with pytest.raises(PlanError):
        export_step(step)
    r = _cli("consolidate", str(step), str(tmp_path / "out"))

    assert r.returncode == 2
    assert [ln for ln in r.stderr.splitlines() if ln.startswith("stagerd:")] == r.stderr.splitlines()[:1]
    assert "\x1b" not in r.stderr and "\x00" not in r.stderr and "\r" not in r.stderr
    assert len(r.stderr.splitlines()) == 2  # the error and its hint
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------- symlinks


def _outside(tmp_path: Path) -> Path:
    d = tmp_path / "outside"
    d.mkdir(exist_ok=True)
    return d


def link_extra_outside(step: Path, tmp_path: Path) -> Path:
    secret = _outside(tmp_path) / "secret.json"
    secret.write_text('{"token": "outside-root"}')
    (step / "extras" / "config.json").unlink()
    (step / "extras" / "config.json").symlink_to(secret)
    return secret


def link_extras_dir_outside(step: Path, tmp_path: Path) -> Path:
    target = _outside(tmp_path) / "extras"
    shutil.move(step / "extras", target)
    (step / "extras").symlink_to(target, target_is_directory=True)
    return target


def link_model_dir_outside(step: Path, tmp_path: Path) -> Path:
    target = _outside(tmp_path) / "model"
    shutil.move(step / "model", target)
    (step / "model").symlink_to(target, target_is_directory=True)
    return target


def link_shard_to_dev_zero(step: Path, tmp_path: Path) -> Path:
    shard = sorted((step / "model").glob("*.safetensors"))[0]
    shard.unlink()
    shard.symlink_to("/dev/zero")
    return Path("/dev/zero")


LINKS = [link_extra_outside, link_extras_dir_outside, link_model_dir_outside, link_shard_to_dev_zero]


@pytest.mark.parametrize("make_link", LINKS, ids=[f.__name__ for f in LINKS])
def test_links_out_of_the_step_are_refused(step_dir, tmp_path, make_link):
    target = make_link(step_dir, tmp_path)
    before = {p: p.read_bytes() for p in _outside(tmp_path).rglob("*") if p.is_file()}

    with pytest.raises(MarkerError, match="outside the step directory") as info:
        export_step(step_dir)

    assert info.value.path and str(step_dir) in info.value.path
    assert not (step_dir / layout.EXPORT_DIR).exists() and not (step_dir / layout.EXPORT_TMP_DIR).exists()
    assert target.exists()
    assert {p: p.read_bytes() for p in _outside(tmp_path).rglob("*") if p.is_file()} == before


def test_a_step_directory_that_is_a_link_out_of_root_is_never_scanned(step_dir, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / "step-00000200").symlink_to(step_dir, target_is_directory=True)
    real = root / "step-00000300"
    real.mkdir()
    commit_step(real, world=1)

    assert layout.committed_steps(root) == [(300, real)]


# ---------------------------------------------------------------------------------------------- marker paths

ESCAPES = [
    "/etc/passwd",
    "model/../../x",
    "model/../../../etc/passwd",
    "model\\..\\..\\x",
    "model/a\x00b.safetensors",
    "model//x",
    "./model/x",
    "model/./x",
    "",
    "model/\x1b[2Jx",
]


@pytest.mark.parametrize("bad", ESCAPES, ids=[repr(e) for e in ESCAPES])
def test_marker_entries_outside_the_step_are_refused(step_dir, tmp_path, bad):
    m = commit_marker.read_marker(step_dir)
    raw = m.to_json()
    raw["files"].append({"path": bad, "size": 10})
    (step_dir / layout.MARKER_NAME).write_text(json.dumps(raw))

    with pytest.raises(MarkerError, match=r"relative path|escapes") as info:
        export_step(step_dir)
    assert info.value.path == str(step_dir / layout.MARKER_NAME)
    assert not (step_dir / layout.EXPORT_DIR).exists() and not (step_dir / layout.EXPORT_TMP_DIR).exists()

    r = _cli("consolidate", str(step_dir), str(tmp_path / "out"))
    assert r.returncode == 2 and "MarkerError" in r.stderr and "\x1b" not in r.stderr
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------- not a file


def test_a_fifo_named_like_a_shard_is_refused_not_waited_on(dcp_mixed, tmp_path):
    """Opening a FIFO for reading blocks until a writer comes: the reader must check the file type first."""
    src, _ = dcp_mixed
    model = tmp_path / "model"
    shutil.copytree(src, model)
    fifo = sorted(model.glob("*.safetensors"))[0]
    fifo.unlink()
    os.mkfifo(fifo)

    r = _cli("consolidate", str(model), str(tmp_path / "out"), timeout=30)  # a wait on the FIFO fails here
    assert r.returncode == 2 and "Error" in r.stderr and str(fifo) in r.stderr
    assert not (tmp_path / "out").exists()


def test_a_fifo_listed_in_the_marker_is_refused(step_dir):
    shard = sorted((step_dir / "model").glob("*.safetensors"))[0]
    size = shard.stat().st_size
    shard.unlink()
    os.mkfifo(shard)
    m = commit_marker.read_marker(step_dir)
    assert any(f.size == size for f in m.files)

    with pytest.raises(ShardError):
        export_step(step_dir)


# ---------------------------------------------------------------------------------------------- many tensors

# Enough that a per-tensor cost or a tensor-count limit shows; 100k tensors are bench_consolidate's
# --many-tensors case and test_plan_memory's bound, not this exactness check's.
TINY = 2_500


def tiny_tensors() -> dict[str, tuple[torch.Tensor, str]]:
    """2 x TINY one-element chunks: a replicated 1-element tensor and a 2-element one split over 2 ranks."""
    out = {}
    for i in range(TINY):
        out[f"model.layers.{i}.scale"] = (torch.tensor([float(i)]), "R")
        out[f"model.layers.{i}.bias"] = (torch.tensor([i, -i], dtype=torch.int32), "S0")
    return out


@pytest.mark.slow
def test_five_thousand_tiny_tensors_export_exactly(tmp_path):
    step = tmp_path / "step-00000001"
    full = dcp_save(step / "model", world=2, builder=tiny_tensors)
    commit_step(step, world=2)

    result = export_step(step)

    assert result.tensors == 2 * TINY
    got = load_all(step / layout.EXPORT_DIR)
    assert set(got) == set(full)
    for name, ref in full.items():
        assert got[name].dtype == ref.dtype and torch.equal(got[name], ref), name
