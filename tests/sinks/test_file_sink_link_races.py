"""A file:// sink's directory swapped for a link to a directory outside the sink at the very moment between
the sink reaching it and acting in it (a write, a rename, a create, a retention delete, a read back, a
listing): the act is refused with a SymlinkError naming the link, and nothing outside is written, read or
deleted. Before, each of them checked the path for links and then acted by path, through the new link.

The link is put in by a wrapper of the `os` call that acts, just before it runs: the backend has already
reached the directory (checked it, before; held it open, now) by then."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from stagerd.cmd.restore import restore_export
from stagerd.contract import layout
from stagerd.errors import SymlinkError
from stagerd.sinks.claims import CLAIMS_DIR
from stagerd.sinks.fsspec import FsspecSink
from stagerd.sinks.prune import prune
from stagerd.sinks.prune_plan import Policy
from stagerd.sinks.remote import RemoteStore
from tests.open_fds import open_fds
from tests.sinks.test_sink_fsspec import make_export

STEP1, STEP2 = layout.step_dir_name(1), layout.step_dir_name(2)
FILES = {"a.safetensors": 100, "sub/b.json": 10}


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A directory outside the sink holding what a write, read or delete led there would touch."""
    v = tmp_path / "victim"
    return make_export(v, FILES, seed=9)


def _plant_on(
    monkeypatch: pytest.MonkeyPatch, call: str, hit: Callable[[Any], bool], linked: Path, victim: Path
) -> list[bool]:
    """Wrap `os.<call>`: the first time its first argument is `hit`, move the real directory `linked`
    aside (inside the sink) and put a link to `victim` in its place, then let the call run."""
    real, done = getattr(os, call), []

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not done and hit(args[0]):
            done.append(True)
            os.rename(linked, linked.with_name(f".aside-{linked.name}"))
            os.symlink(victim, linked)
        return real(*args, **kwargs)

    monkeypatch.setattr(os, call, wrapper)
    return done


def _named(ending: str) -> Callable[[Any], bool]:
    return lambda a: isinstance(a, (str, os.PathLike)) and os.fspath(a).endswith(ending)


def _temp_of(name: str) -> Callable[[Any], bool]:
    return lambda a: isinstance(a, (str, os.PathLike)) and Path(a).name.startswith(f".{name}.tmp-")


def _published(tmp_path: Path, *steps: int) -> tuple[Path, FsspecSink]:
    sink_dir = tmp_path / "sink"
    sink = FsspecSink.from_url(sink_dir.as_uri())
    for step in steps:
        sink.publish(make_export(tmp_path / f"e{step}", FILES, seed=step), step)
    return sink_dir, sink


@pytest.mark.parametrize(
    ("call", "hit", "linked"),
    [
        ("open", _temp_of("a.safetensors"), STEP2),  # an uploaded file's temp write
        ("replace", _temp_of("a.safetensors"), STEP2),  # its rename into place
        ("open", _temp_of(layout.MANIFEST_NAME), STEP2),  # the manifest's create
        ("open", _temp_of(STEP2), CLAIMS_DIR),  # the step's claim's create
    ],
    ids=["upload-write", "upload-rename", "manifest-create", "claim-create"],
)
def test_a_link_put_in_before_a_publish_writes_is_refused_and_nothing_outside_changes(
    tmp_path: Path, victim: Path, monkeypatch: pytest.MonkeyPatch, call: str, hit: Any, linked: str
):
    """Before: the upload's temp file, the manifest and the claim were written in the victim (its
    `a.safetensors` replaced), and the rename failed as a FileNotFoundError naming no link."""
    sink_dir, sink = _published(tmp_path, 1)
    before = _tree(victim)
    export = make_export(tmp_path / "e2", FILES, seed=2)
    planted = _plant_on(monkeypatch, call, hit, sink_dir / linked, victim)
    with pytest.raises(SymlinkError, match="only inside the sink") as e:
        sink.publish(export, 2)
    assert planted and e.value.path == str(sink_dir / linked) and e.value.hint
    assert _tree(victim) == before
    assert not any(n.startswith(".") for n in os.listdir(victim))  # no temp file left there either


def test_a_link_put_in_before_a_retention_delete_deletes_nothing_outside(
    tmp_path: Path, victim: Path, monkeypatch: pytest.MonkeyPatch
):
    """Before: `keep_last 1` deleted the victim's files through the link, and reported step 1 pruned."""
    sink_dir, _ = _published(tmp_path, 1, 2)
    (victim / layout.MANIFEST_NAME).write_bytes(b'{"forged": true}')
    before = _tree(victim)
    planted = _plant_on(monkeypatch, "unlink", _named(layout.MANIFEST_NAME), sink_dir / STEP1, victim)
    decisions = prune(RemoteStore.open(sink_dir.as_uri()), Policy(keep_last=1))
    (first,) = [d for d in decisions if d.step == 1 and d.tree == "export"]
    assert planted and not first.delete
    assert "only inside the sink" in first.reason and str(sink_dir / STEP1) in first.reason
    assert _tree(victim) == before
    assert (sink_dir / STEP2 / layout.MANIFEST_NAME).is_file()  # the step kept is kept


def test_a_link_put_in_before_a_read_back_is_refused(tmp_path: Path, victim: Path, monkeypatch):
    """Before: the manifest read back (as a publish verifies and a prune judges) was the victim's."""
    sink_dir, sink = _published(tmp_path, 1)
    (victim / layout.MANIFEST_NAME).write_bytes(b'{"forged": true}')
    planted = _plant_on(monkeypatch, "open", _named(layout.MANIFEST_NAME), sink_dir / STEP1, victim)
    with pytest.raises(SymlinkError, match="only inside the sink") as e:
        sink.backend.read(f"{STEP1}/{layout.MANIFEST_NAME}")
    assert planted and e.value.path == str(sink_dir / STEP1)


def test_a_link_put_in_before_a_restore_reads_is_refused(tmp_path: Path, victim: Path, monkeypatch):
    """Before: once the listing was checked, the restore read the victim's files through the link (and
    failed on their sha256, naming no link)."""
    sink_dir, _ = _published(tmp_path, 1)
    planted = _plant_on(monkeypatch, "open", _named("a.safetensors"), sink_dir / STEP1, victim)
    out = tmp_path / "restored"
    with pytest.raises(SymlinkError, match="only inside the sink") as e:
        restore_export(RemoteStore.open(sink_dir.as_uri()), out, 1)
    assert planted and e.value.path == str(sink_dir / STEP1)
    assert not out.exists()


def test_a_link_put_in_before_a_listing_is_refused(tmp_path: Path, victim: Path, monkeypatch):
    """Before: the step's listing (what verification compares with the manifest) was the victim's files."""
    sink_dir, sink = _published(tmp_path, 1)

    def the_step(a: Any) -> bool:
        path = os.readlink(f"/proc/self/fd/{a}") if isinstance(a, int) else os.fspath(a)
        return path == str(sink_dir / STEP1)

    planted = _plant_on(monkeypatch, "scandir", the_step, sink_dir / STEP1, victim)
    with pytest.raises(SymlinkError, match="only inside the sink") as e:
        sink.backend.list(STEP1)
    assert planted and e.value.path == str(sink_dir / STEP1)


def test_a_publish_holds_a_few_descriptors_however_many_files_and_leaks_none(tmp_path: Path, monkeypatch):
    sink_dir = tmp_path / "sink"
    sink = FsspecSink.from_url(sink_dir.as_uri())
    export = make_export(tmp_path / "e", {f"d{i % 20}/f{i}.json": 10 for i in range(400)})
    most, real = [0], os.open

    def counting(*args: Any, **kwargs: Any) -> int:
        fd = real(*args, **kwargs)
        most[0] = max(most[0], open_fds(sink_dir))
        return fd

    monkeypatch.setattr(os, "open", counting)
    before = open_fds(tmp_path)
    sink.publish(export, 1)
    store = RemoteStore.open(sink_dir.as_uri())
    assert len(store.objects(STEP1)) == 401
    store.delete([f"{STEP1}/{rel}" for rel in store.objects(STEP1)])
    store.remove_empty_dirs(STEP1)
    assert not (sink_dir / STEP1).exists()
    assert open_fds(tmp_path) == before
    assert 0 < most[0] <= 5  # the root, the step, one directory in it, one file, one lock or probe
