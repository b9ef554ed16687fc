"""A step the daemon journaled as a real directory, later replaced by a symbolic link (the whole step, or
its `export/`): the daemon exported through the link (reading, deleting and writing outside ROOT) and
published what the link led to. Now such a step is refused with a SymlinkError naming the link, nothing the
link leads to is read, written or published, and the other steps go on. The journal is the real SQLite
file of a real `stagerd watch` run killed at a crash point; the sink is a real directory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import pytest

from stagerd.contract import commit_marker, layout
from stagerd.contract.manifest import ExportManifest
from stagerd.contract.step.held import refuse_links
from stagerd.errors import SymlinkError
from tests.cli_helpers import run_cli
from tests.daemon_helpers import fast_flags, stage_copy
from tests.open_fds import open_fds


def _watch(root: Path, sink: Path, *extra: str, crash: str | None = None):
    env = {"STAGERD_CRASH_AT": crash} if crash else None
    args = ["watch", root, "--sink", sink.as_uri(), "--once", *fast_flags(), *extra]
    return run_cli(args, env=env, timeout=120)


def _tree(d: Path) -> dict[str, bytes]:
    """Every file under `d` and its bytes, links not followed: what must not change."""
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _published(sink: Path) -> list[str]:
    return sorted(p.name for p in sink.glob("step-*") if (p / layout.MANIFEST_NAME).is_file())


def test_a_step_replaced_by_a_link_is_neither_exported_nor_published(tmp_path, dcp_mixed2):
    """Step 1 journaled and its export begun (the daemon killed mid-way), then moved to another disk and
    linked back. The next run removed the export.tmp/ the link led to, built an export there (outside
    ROOT) and published it (and its raw files). Now: SymlinkError for step 1 (its export and its raw lane),
    its target untouched, step 2 goes on."""
    model, _ = dcp_mixed2
    root, sink, elsewhere = tmp_path / "root", tmp_path / "sink", tmp_path / "elsewhere"
    step1 = stage_copy(root, 1, model, world=2)
    killed = _watch(root, sink, crash="export.move:1")
    assert killed.returncode == -9, killed.stderr[-3000:]
    stage_copy(root, 2, model, world=2)
    elsewhere.mkdir()
    shutil.move(step1, elsewhere / step1.name)
    step1.symlink_to(elsewhere / step1.name, target_is_directory=True)
    before = _tree(elsewhere)

    r = _watch(root, sink, "--publish-raw")
    assert r.returncode == 1, r.stderr[-3000:]
    assert "SymlinkError" in r.stderr and str(step1) in r.stderr, r.stderr[-3000:]
    assert _tree(elsewhere) == before  # nothing removed, nothing written where the link leads
    assert _published(sink) == [layout.step_dir_name(2)]
    assert not (sink / "raw" / layout.step_dir_name(1)).exists()
    assert (sink / "raw" / layout.step_dir_name(2) / layout.MANIFEST_NAME).is_file()
    assert step1.is_symlink()  # the link is left for the user to put right


def test_an_export_replaced_by_a_link_is_never_published(tmp_path, dcp_mixed2):
    """Step 1 exported, the daemon killed before it published (the export recorded as the daemon records
    it), then its `export/` replaced by a link to a directory holding the same export and a private file:
    the next run published that directory, private file and all. Now: SymlinkError for step 1 on the sink,
    nothing of it published, the directory untouched, step 2 goes on."""
    from stagerd.daemon.journal import Journal

    model, _ = dcp_mixed2
    root, sink, private = tmp_path / "root", tmp_path / "sink", tmp_path / "private"
    step1 = stage_copy(root, 1, model, world=2)
    killed = _watch(root, sink, crash="export.renamed:1")
    assert killed.returncode == -9, killed.stderr[-3000:]
    journal = Journal.open(root)
    try:
        journal.finish_export(
            1, [sink.as_uri()], seconds=0.1, export_bytes=1, tensor_bytes=1, files=2, skipped=False
        )
    finally:
        journal.close()
    export = step1 / layout.EXPORT_DIR
    shutil.move(export, private)
    (private / "id_ed25519").write_bytes(b"not for the hub")
    export.symlink_to(private, target_is_directory=True)
    stage_copy(root, 2, model, world=2)
    before = _tree(private)

    r = _watch(root, sink)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "SymlinkError" in r.stderr and str(export) in r.stderr, r.stderr[-3000:]
    assert not list(sink.rglob("id_ed25519"))
    assert _published(sink) == [layout.step_dir_name(2)]
    assert _tree(private) == before


@pytest.mark.parametrize(
    "part", [layout.MARKER_NAME, layout.MODEL_DIR, layout.EXPORT_DIR, layout.EXPORT_TMP_DIR]
)
def test_each_part_the_daemon_touches_is_checked_from_the_directory_itself(tmp_path, part):
    """A real step directory one of whose parts is a link: refused by name, the target not opened."""
    step, target = tmp_path / layout.step_dir_name(1), tmp_path / "target"
    step.mkdir()
    target.mkdir()
    (step / part).symlink_to(target, target_is_directory=True)
    args = {"why": "test", "hint": "put it back"}
    with pytest.raises(SymlinkError) as e:
        refuse_links(step, [layout.EXTRAS_DIR, part], **args)
    assert e.value.path == str(step / part) and e.value.hint == "put it back"
    assert f"-> {target}" in e.value.message
    assert refuse_links(step, [layout.EXTRAS_DIR], **args)  # a part that is not there is not checked
    assert not refuse_links(tmp_path / "gone", [part], **args)  # a step gone: its caller names that


@pytest.mark.parametrize("part", [".", layout.EXPORT_DIR])
def test_a_step_linked_away_mid_publish_publishes_only_the_export_checked(tmp_path, step_dir, part):
    """The step (or its export/) checked, then swapped for a link to a directory whose export holds a
    private file, while the sink reads it: the sink published that, private file and all. Now the sink
    reads the export/ the daemon holds open (the one it checked): it is published, nothing of the link's."""
    from stagerd.config import Settings
    from stagerd.daemon.core import Daemon
    from stagerd.engine.export import export_step
    from stagerd.sinks import open_sink

    export_step(step_dir)
    export, swapped, sink = step_dir / layout.EXPORT_DIR, (step_dir / part).resolve(), tmp_path / "sink"
    private = tmp_path / "private"
    shutil.copytree(swapped, private)
    (private / export.relative_to(swapped) / "id_ed25519").write_bytes(b"not for the hub")
    before = _tree(private)
    d = Daemon(Settings(root=str(tmp_path), sinks=[sink.as_uri()], once=True, metrics_port=0))
    s = open_sink(sink.as_uri())
    publish = s.publish

    def swap_then_publish(export_dir: Path, *args, **kwargs):
        swapped.rename(tmp_path / "aside")
        swapped.symlink_to(private, target_is_directory=True)
        return publish(export_dir, *args, **kwargs)

    s.publish = swap_then_publish  # type: ignore[method-assign]
    d._sinks[s.url] = s
    try:
        d._run_publish(100, s.url, export, {}, d._yielder("publish", 100, s.url))
    finally:
        s.close()
    assert not list(sink.rglob("id_ed25519"))
    assert _published(sink) == [step_dir.name]
    assert _tree(private) == before


def test_a_step_linked_away_mid_raw_publish_sends_only_the_step_checked(tmp_path, step_dir):
    """The step checked, then swapped for a link to a copy whose shard holds other bytes of the same size
    (every check by name and size passes), while the raw lane reads it: that copy's bytes were published as
    the step's. Now the raw lane reads the step it holds open: its own bytes are sent."""
    from stagerd.config import Settings
    from stagerd.daemon.core import Daemon
    from stagerd.daemon.journal.raw import raw_lane
    from stagerd.sinks import open_sink

    shard = sorted((step_dir / layout.MODEL_DIR).glob("*.safetensors"))[0].relative_to(step_dir)
    want = (step_dir / shard).read_bytes()
    other, sink = tmp_path / "other", tmp_path / "sink"
    shutil.copytree(step_dir, other)
    (other / shard).write_bytes(want[:-64] + bytes(b ^ 0x5A for b in want[-64:]))
    d = Daemon(Settings(root=str(tmp_path), sinks=[sink.as_uri()], once=True, metrics_port=0))
    s = open_sink(sink.as_uri())
    publish_raw = s.publish_raw  # type: ignore[attr-defined]

    def swap_then_publish(step_path: Path, *args, **kwargs):
        step_dir.rename(tmp_path / "aside")
        step_dir.symlink_to(other, target_is_directory=True)
        return publish_raw(step_path, *args, **kwargs)

    s.publish_raw = swap_then_publish  # type: ignore[attr-defined]
    key = raw_lane(s.url)
    d._raw_sinks[key] = s  # type: ignore[assignment]
    try:
        d._run_raw(100, key, step_dir)
    finally:
        s.close()
    assert (sink / "raw" / step_dir.name / shard).read_bytes() == want


def _raw_daemon(tmp_path: Path, sink: Path):
    """A daemon whose one raw lane publishes to the file:// sink `sink`, and that lane's key and sink."""
    from stagerd.config import Settings
    from stagerd.daemon.core import Daemon
    from stagerd.daemon.journal.raw import raw_lane
    from stagerd.sinks import open_sink

    d = Daemon(Settings(root=str(tmp_path), sinks=[sink.as_uri()], once=True, metrics_port=0))
    s = open_sink(sink.as_uri())
    key = raw_lane(s.url)
    d._raw_sinks[key] = s  # type: ignore[assignment]
    return d, key, s


def _with_optim(step_dir: Path) -> None:
    """The step with an optimizer shard too, listed in its marker as the Stager lists it."""
    (step_dir / layout.OPTIM_DIR).mkdir()
    (step_dir / layout.OPTIM_DIR / "__0_0.distcp").write_bytes(bytes(range(256)) * 8)
    m = commit_marker.read_marker(step_dir)
    listed = commit_marker.StagedFile(f"{layout.OPTIM_DIR}/__0_0.distcp", 2048)
    commit_marker.write_marker(step_dir, dataclasses.replace(m, files=(*m.files, listed)))


@pytest.mark.parametrize("part", [layout.MODEL_DIR, layout.OPTIM_DIR, "shard"])
def test_a_part_linked_away_mid_raw_publish_sends_only_the_steps_bytes(tmp_path, step_dir, part):
    """`model/`, `optim/` or one shard swapped for a link to a copy of other bytes of the same sizes after
    `publish_raw` checked the step, before it read it: the copy's bytes went up under this step's raw prefix
    and its manifest vouched for them (a resume would restore other weights or another optimizer). Now
    every listed file is read through handles held from the step: its own bytes are sent."""
    _with_optim(step_dir)
    if part == "shard":
        part = str(sorted((step_dir / layout.MODEL_DIR).glob("*.safetensors"))[0].relative_to(step_dir))
    want = _tree(step_dir)
    other, sink = tmp_path / "other", tmp_path / "sink"
    (shutil.copytree if (step_dir / part).is_dir() else shutil.copyfile)(step_dir / part, other)
    for p in [other] if other.is_file() else [p for p in other.rglob("*") if p.is_file()]:
        p.write_bytes(bytes(b ^ 0x5A for b in p.read_bytes()))
    d, key, s = _raw_daemon(tmp_path, sink)
    publish_tree = s._publish_tree  # type: ignore[attr-defined]

    def swap_then_send(*args, **kwargs):
        (step_dir / part).rename(tmp_path / "aside")
        (step_dir / part).symlink_to(other, target_is_directory=other.is_dir())
        return publish_tree(*args, **kwargs)

    s._publish_tree = swap_then_send  # type: ignore[attr-defined]
    fds = open_fds(tmp_path)
    try:
        d._run_raw(100, key, step_dir)
        assert open_fds(tmp_path) == fds  # every handle closed with the publish
    finally:
        s.close()
    sent = sink / "raw" / step_dir.name
    assert {k: v for k, v in _tree(sent).items() if k != layout.MANIFEST_NAME} == want
    manifest = ExportManifest.from_json(json.loads((sent / layout.MANIFEST_NAME).read_bytes()))
    assert {f.path: f.sha256 for f in manifest.files} == {
        k: hashlib.sha256(v).hexdigest() for k, v in want.items()
    }


def test_a_listed_file_that_is_a_link_inside_the_step_is_never_sent_raw(tmp_path, step_dir):
    """A shard that is a link to a copy inside the step (the marker's "resolves inside the step" check
    passes, and the daemon's own check looks only at the step's parts): the copy was sent as the shard. Now
    a SymlinkError naming it, in one line with a hint; nothing of the step published."""
    shard = sorted((step_dir / layout.MODEL_DIR).glob("*.safetensors"))[0]
    copy = step_dir / ".copy"
    shutil.copyfile(shard, copy)
    shard.unlink()
    shard.symlink_to(copy)
    sink = tmp_path / "sink"
    d, key, s = _raw_daemon(tmp_path, sink)
    try:
        with pytest.raises(SymlinkError) as e:
            d._run_raw(100, key, step_dir)
    finally:
        s.close()
    assert e.value.path == str(shard) and "\n" not in str(e.value) and e.value.hint
    assert not (sink / "raw").exists() or not list((sink / "raw").rglob("*.safetensors"))
    assert not (sink / "raw" / step_dir.name / layout.MANIFEST_NAME).exists()


def test_a_marker_no_scan_can_read_stops_its_step_alone(tmp_path, dcp_mixed2):
    """A step whose commit marker is a link loop (or, for a daemon not run as root, a directory it may not
    enter): its stat failed the whole scan, so no step was published and a running daemon's every rescan
    failed. Now that step alone is quarantined with the error named, and step 2 is published."""
    model, _ = dcp_mixed2
    root, sink = tmp_path / "root", tmp_path / "sink"
    step1 = stage_copy(root, 1, model, world=2)
    stage_copy(root, 2, model, world=2)
    marker = step1 / layout.MARKER_NAME
    marker.unlink()
    marker.symlink_to(marker.name)

    r = _watch(root, sink)
    assert r.returncode == 1, r.stderr[-3000:]
    assert _published(sink) == ["step-00000002"]
    assert "step 1 not published: quarantined: SymlinkError" in r.stderr, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
