"""A step's input files beyond the descriptors the process may hold (`contract/step/reopen.py`): closed once
checked, opened again only through the held directory they were opened from, without following a link,
and only if they are still the very files checked; a file swapped while closed is a SourceChangedError, and
nothing of it is read, exported or sent. The budget is made small here instead of the process's limit
(tests/daemon/test_open_files.py runs the daemon under a real hard limit below a step's file count)."""

from __future__ import annotations

import os
import random
import shutil
import threading
from pathlib import Path

import pytest

from stagerd.contract import layout
from stagerd.contract.step import input_fds, reopen
from stagerd.contract.step.held import HeldDir, HeldFiles, reading
from stagerd.contract.step.reopen import open_held
from stagerd.errors import SourceChangedError
from tests.open_fds import open_fds


@pytest.fixture
def budget(monkeypatch):
    """budget(n): the process may hold n input descriptors (half of them the held steps' files)."""

    def set_budget(n: int) -> None:
        monkeypatch.setattr(reopen, "descriptor_budget", lambda: n)
        monkeypatch.setattr(input_fds, "descriptor_budget", lambda: n)

    return set_budget


def _files(d: Path, n: int) -> dict[str, bytes]:
    d.mkdir()
    want = {f"f{i}": bytes([i]) * (100 + i) for i in range(n)}
    for name, data in want.items():
        (d / name).write_bytes(data)
    return want


def _read(path: Path) -> bytes:
    with open(path, "rb", opener=open_held) as f:
        return f.read()


def test_files_beyond_the_budget_are_closed_and_read_as_themselves(tmp_path, budget):
    budget(2)  # one file held open; the others closed once checked
    want = _files(tmp_path / "d", 5)
    before = open_fds(tmp_path)
    with HeldDir.open(tmp_path / "d") as d, HeldFiles() as files:
        paths = {name: files.open(d, name, bounded=True) for name in want}
        assert open_fds(tmp_path) == before + 2  # the directory and one file
        assert sum(reopen.closed(p) is not None for p in paths.values()) == 4
        assert {name: _read(p) for name, p in paths.items()} == want
        for name, p in paths.items():
            with reading(p) as now:
                assert now.read_bytes() == want[name]
        assert files.open(d, "f4", bounded=True) == paths["f4"]  # opened once, however often it is read
        assert files.replaced() is None
        (tmp_path / "d" / "f4").rename(tmp_path / "aside")
        assert files.replaced() == tmp_path / "d" / "f4"
    assert open_fds(tmp_path) == before and all(reopen.closed(p) is None for p in paths.values())
    assert reopen.held() == 0


@pytest.mark.parametrize("swap", ["renamed over", "link", "rewritten", "deleted"])
def test_a_file_swapped_while_closed_is_caught_when_opened_again(tmp_path, budget, swap):
    """A link put in its place (to a copy of the same bytes) is never followed, another file renamed over it
    or the same file rewritten is not read: a SourceChangedError naming the file, in one line."""
    budget(2)
    _files(tmp_path / "d", 2)
    real = tmp_path / "d" / "f1"
    with HeldDir.open(tmp_path / "d") as d, HeldFiles() as files, files.naming():
        files.open(d, "f0", bounded=True)
        path = files.open(d, "f1", bounded=True)
        assert reopen.closed(path) is not None
        copy = tmp_path / "copy"
        shutil.copy2(real, copy)
        if swap == "renamed over":
            copy.rename(real)
        elif swap == "link":
            real.unlink()
            real.symlink_to(copy)
        elif swap == "rewritten":
            real.write_bytes(b"x" * 7)
        else:
            real.unlink()
        for opening in (lambda: _read(path), lambda: reading(path).__enter__()):
            with pytest.raises(SourceChangedError) as e:
                opening()
            assert e.value.path == str(real) and "/proc/" not in str(e.value) and e.value.retryable
            assert len(str(e.value).splitlines()) == 1


def test_lazy_descriptors_read_each_input_right_from_many_threads(tmp_path):
    want = _files(tmp_path / "d", 12)
    paths = [str(tmp_path / "d" / name) for name in want]
    data = list(want.values())
    before = open_fds(tmp_path)
    fds = input_fds.LazyFds(paths, cap=3)
    errors: list[str] = []

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(300):
            i = rng.randrange(len(paths))
            if os.pread(fds[i], len(data[i]), 0) != data[i]:
                errors.append(paths[i])
            if open_fds(tmp_path) > before + 3:
                errors.append("over the cap")

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    input_fds.close_inputs(fds)
    assert errors == [] and open_fds(tmp_path) == before


def test_lazy_descriptors_out_of_room_close_their_spares_and_go_on(tmp_path, monkeypatch):
    """The rest of the process took more than its margin: the next open fails with EMFILE. The ones no
    thread reads are closed and the open tried again, instead of failing the export."""
    import errno

    want = _files(tmp_path / "d", 6)
    paths = [str(tmp_path / "d" / name) for name in want]
    fds = input_fds.LazyFds(paths, cap=6)
    for i in range(5):
        fds[i]
    real_open, failed = reopen.open_held, []

    def full_once(path: str, flags: int = os.O_RDONLY, mode: int = 0o777) -> int:
        if not failed:
            failed.append(path)
            raise OSError(errno.EMFILE, "Too many open files", path)
        return real_open(path, flags, mode)

    monkeypatch.setattr(reopen, "open_held", full_once)
    try:
        assert os.pread(fds[5], 200, 0) == want["f5"] and failed == [paths[5]]
        assert len(fds._open) == 1  # the other five closed to make room
    finally:
        input_fds.close_inputs(fds)


def _tree(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_an_export_of_shards_closed_for_want_of_descriptors_is_the_same(step_dir, tmp_path, budget):
    from stagerd.engine.export import export_step

    ref = tmp_path / "reference" / step_dir.name
    shutil.copytree(step_dir, ref)
    export_step(ref)
    budget(2)
    before = open_fds(tmp_path)
    export_step(step_dir)
    assert _tree(step_dir / layout.EXPORT_DIR) == _tree(ref / layout.EXPORT_DIR)
    assert open_fds(tmp_path) == before and reopen.held() == 0


def test_a_shard_swapped_while_closed_fails_the_export(step_dir, tmp_path, monkeypatch, budget):
    """The last shard closed after its header was read, then swapped for a link to a copy with other bytes
    of the same size before the plan reads it: a SourceChangedError naming it, nothing exported."""
    from stagerd.engine import consolidate as consolidate_mod
    from stagerd.engine.export import export_step

    budget(2)
    shard = sorted((step_dir / layout.MODEL_DIR).glob("*.safetensors"))[-1]
    other = tmp_path / "other.safetensors"
    data = shard.read_bytes()
    other.write_bytes(data[:-8] + bytes(b ^ 0x5A for b in data[-8:]))
    execute = consolidate_mod.execute

    def swap_then_read(*args: object, **kwargs: object) -> object:
        shard.rename(tmp_path / "aside")
        shard.symlink_to(other)
        return execute(*args, **kwargs)

    monkeypatch.setattr(consolidate_mod, "execute", swap_then_read)
    with pytest.raises(SourceChangedError) as e:
        export_step(step_dir)
    assert e.value.path == str(shard) and "/proc/" not in str(e.value)
    assert not (step_dir / layout.EXPORT_DIR).exists() and not (step_dir / layout.EXPORT_TMP_DIR).exists()


def test_a_raw_file_swapped_while_closed_is_not_sent(tmp_path, step_dir, budget):
    from stagerd.config import Settings
    from stagerd.daemon.core import Daemon
    from stagerd.daemon.journal.raw import raw_lane
    from stagerd.sinks import open_sink

    budget(2)
    sink = tmp_path / "sink"
    shard = sorted((step_dir / layout.MODEL_DIR).glob("*.safetensors"))[-1]
    other = tmp_path / "other.safetensors"
    data = shard.read_bytes()
    other.write_bytes(data[:-8] + bytes(b ^ 0x5A for b in data[-8:]))
    d = Daemon(Settings(root=str(tmp_path), sinks=[sink.as_uri()], once=True, metrics_port=0))
    s = open_sink(sink.as_uri())
    key = raw_lane(s.url)
    d._raw_sinks[key] = s  # type: ignore[assignment]
    publish_tree = s._publish_tree  # type: ignore[attr-defined]

    def swap_then_send(*args: object, **kwargs: object) -> object:
        shard.rename(tmp_path / "aside")
        shard.symlink_to(other)
        return publish_tree(*args, **kwargs)

    s._publish_tree = swap_then_send  # type: ignore[attr-defined]
    try:
        with pytest.raises(SourceChangedError) as e:
            d._run_raw(100, key, step_dir)
    finally:
        s.close()
    assert e.value.path == str(shard) and "/proc/" not in str(e.value)
    assert not (sink / "raw" / step_dir.name / layout.MANIFEST_NAME).exists()
    assert not list(sink.rglob(shard.name)) or all(p.read_bytes() == data for p in sink.rglob(shard.name))


def _adoptable(ckpt: Path) -> list[Path]:
    """A trainer's FileSystemWriter checkpoint of four data files (one per writer thread)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    g = torch.Generator().manual_seed(5)
    state = {"model": {f"layers.{i}.weight": torch.randn(16, 8, generator=g) for i in range(8)}}
    dcp.save(state, storage_writer=FileSystemWriter(str(ckpt), thread_count=4), no_dist=True)
    return sorted(ckpt.glob("*.distcp"))


def test_an_adopted_checkpoint_of_data_files_closed_for_want_of_descriptors(tmp_path, monkeypatch, budget):
    """Exported the same as with every data file held; a data file swapped while closed (after its records
    were read, before the plan copies it, and put back before the end's check) is a SourceChangedError
    naming it, nothing read through the link."""
    from stagerd.engine import consolidate as consolidate_mod
    from stagerd.engine.adopt.export import export_adopted

    ckpt = tmp_path / "step-1"
    data = _adoptable(ckpt)
    assert len(data) == 4
    want = _tree(export_adopted(ckpt, tmp_path / "held").export_dir)
    budget(2)
    assert _tree(export_adopted(ckpt, tmp_path / "closed").export_dir) == want
    assert reopen.held() == 0
    other = tmp_path / "other.distcp"
    other.write_bytes(bytes(b ^ 0x5A for b in data[-1].read_bytes()))
    execute = consolidate_mod.execute

    def swap_then_read(*args: object, **kwargs: object) -> object:
        data[-1].rename(tmp_path / "aside")
        data[-1].symlink_to(other)
        try:
            return execute(*args, **kwargs)
        finally:  # put back before the check that the checkpoint held still
            data[-1].unlink()
            (tmp_path / "aside").rename(data[-1])

    monkeypatch.setattr(consolidate_mod, "execute", swap_then_read)
    with pytest.raises(SourceChangedError) as e:
        export_adopted(ckpt, tmp_path / "swapped")
    assert e.value.path == str(data[-1]) and "/proc/" not in str(e.value)


def _row_sharded(src: Path, ranks: int, tensors: int, rows: int, cols: int) -> dict[str, bytes]:
    """A DCP save of `ranks` shard files, each tensor split on dim 0 over every rank (FSDP's layout), as
    HuggingFaceStorageWriter writes it; the tensors' bytes, by name."""
    import json

    import numpy as np

    from stagerd.contract.safetensors_format import encode_header

    src.mkdir()
    names = [f"layers.{i}.weight" for i in range(tensors)]
    full = {
        n: np.arange(ranks * rows * cols, dtype=np.float32).reshape(-1, cols) + i for i, n in enumerate(names)
    }
    size = rows * cols * 4
    for r in range(ranks):
        entries = {n: ("F32", (rows, cols), i * size, (i + 1) * size) for i, n in enumerate(names)}
        info = {n: {"saved_offsets": [r * rows, 0]} for n in names}
        head = encode_header(entries, {"DCP_SHARDING_INFO": json.dumps(info), "format": "pt"})
        data = b"".join(full[n][r * rows : (r + 1) * rows].tobytes() for n in names)
        (src / f"shard-{r + 1:05d}-model-00001-of-00001.safetensors").write_bytes(head + data)
    return {n: v.tobytes() for n, v in full.items()}


def test_an_export_gathered_from_every_rank_beyond_the_limit_opens_each_file_once_a_batch(
    tmp_path, monkeypatch
):
    """More shard files than the process may hold open (a lowered RLIMIT_NOFILE), each tensor gathered from
    every rank: in destination order the most recently read files kept open are never the next one, so
    every piece opened its file again (48 files, 8 tensors: 384 opens). Grouped by source a batch at a time,
    each file is opened once; the export and its verify are the bytes of the tensors."""
    import resource

    from safetensors.numpy import load_file

    from stagerd.engine.consolidate import consolidate_into
    from stagerd.engine.verify import verify_export

    want = _row_sharded(tmp_path / "src", ranks=48, tensors=8, rows=4, cols=8192)  # 128 KiB a block
    (tmp_path / "out").mkdir()
    opened: list[str] = []
    real_open = reopen.open_held

    def counted(path: str, flags: int = os.O_RDONLY, mode: int = 0o777) -> int:
        opened.append(os.path.basename(path))
        return real_open(path, flags, mode)

    monkeypatch.setattr(reopen, "open_held", counted)
    input_fds._room()  # raises the soft limit once a process: before it is lowered here
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # 64 more than are open now (a test worker holds some): about 40 inputs may stay open, not all 48
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_fds() + 64, hard))
    try:
        assert input_fds.descriptor_budget() * 3 // 4 < 48  # the lazy path, not all opened at once
        consolidate_into(tmp_path / "src", tmp_path / "out")
        exported = len(opened)
        verify_export(tmp_path / "out", tmp_path / "src")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert {n: v.tobytes() for n, v in got.items()} == want
    assert exported == 48 and len(opened) == 96, (exported, len(opened))


@pytest.mark.parametrize("dtype", [None, "BF16"])
def test_moves_grouped_by_source_write_the_same_bytes(dcp_mixed, tmp_path, monkeypatch, dtype):
    """Every kind of move (copies, casts, gathers, transposed blocks, packs) run grouped by source in small
    batches, through two lazily opened descriptors: the same files as in destination order, verified."""
    from stagerd.engine import execute, limits
    from stagerd.engine.consolidate import consolidate_into
    from stagerd.engine.verify import verify_export

    src, _ = dcp_mixed
    ref, out = tmp_path / "ref", tmp_path / "out"
    ref.mkdir()
    out.mkdir()
    consolidate_into(src, ref, dtype=dtype, max_shard_size=4096)
    monkeypatch.setattr(limits, "SOURCE_BATCH", 7)
    monkeypatch.setattr(execute, "open_inputs", lambda paths: input_fds.LazyFds(paths, 2))
    consolidate_into(src, out, dtype=dtype, max_shard_size=4096)
    verify_export(out, src)
    assert _tree(out) == _tree(ref)
