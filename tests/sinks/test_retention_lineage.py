"""A run resumed on another node keeps its remote retention. The job lands on a fresh node-local ROOT (a new
identity), `stagerd restore`s the latest step from its prefix and publishes on there. Before, every step the
earlier ROOT published was another publisher's to the new daemon: never counted nor deleted, one warning
each, so `--remote-keep-last N` no longer bounded the prefix. A ROOT that never restored from the prefix
still leaves the other run's steps alone. Stores: moto S3 and real directories; the restores are real
`stagerd restore` children, the publishes the real sink's, the prunes the daemon's own call.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest

from stagerd.contract import layout, lineage
from stagerd.contract.root_id import root_id
from stagerd.sinks.claims import claim_key
from stagerd.sinks.fetch import RemoteStore
from stagerd.sinks.fsspec import FsspecSink
from stagerd.sinks.prune import Owner, Policy, prune
from tests.cli_helpers import run_cli
from tests.dcp_fixtures import commit_step
from tests.s3server import s3, s3_server  # noqa: F401  (fixtures)
from tests.sinks.test_retention_owner import _Prefix, _root


def _publish(root: Path, prefix: _Prefix, *steps: int) -> None:
    """Raw steps of ROOT, as `watch --publish-raw` sends them."""
    sink = FsspecSink.from_url(prefix.url)
    try:
        for s in steps:
            d = root / layout.step_dir_name(s)
            (d / "model").mkdir(parents=True)
            (d / "model" / "__0_0.distcp").write_bytes(bytes([s]) * (300 + s))
            commit_step(d, 1)
            assert not sink.publish_raw(d, s).skipped
    finally:
        sink.close()


def _raw_keys(prefix: _Prefix, step: int) -> set[str]:
    name = layout.step_dir_name(step)
    keys: set[str] = prefix.keys()
    return {k for k in keys if k.startswith(f"shared/raw/{name}/") or k == f"shared/raw/claims/{name}"}


def _prune(prefix: _Prefix, root: Path, keep_last: int) -> dict[int, bool]:
    """The daemon's retention of ROOT after a publish: raw steps' fates."""
    remote = RemoteStore.open(prefix.url)
    try:
        decisions = prune(remote, Policy(keep_last=keep_last), owner=Owner.of(root))
    finally:
        remote.close()
    return {d.step: d.delete for d in decisions if d.tree == "raw"}


def _restore(prefix: _Prefix, root: Path):
    r = run_cli(["restore", prefix.url, root, "--step", "latest"], timeout=120)
    assert r.returncode == 0, r.stderr
    return r


@pytest.mark.parametrize("store", ["file", "s3"])
def test_a_run_resumed_on_a_new_root_through_restore_prunes_the_earlier_roots_steps(
    request, tmp_path, store, caplog
):
    """A publishes 1-3; B, a fresh ROOT, restores the latest step and publishes 4 and 5 with keep-last 2,
    pruning after each as its daemon does: 1 and 2 go after 4, 3 (restored, A's) after 5. Every key of
    A's steps and their claims is gone, 4 and 5 keep theirs, and nothing is logged as another ROOT's."""
    prefix = _Prefix(request, tmp_path, store)
    a, b = _root(tmp_path / "a"), tmp_path / "b"
    _publish(a, prefix, 1, 2, 3)
    _restore(prefix, b)
    assert layout.is_committed(b / layout.step_dir_name(3))
    assert lineage.ancestors(b) == (root_id(a),)
    with caplog.at_level("WARNING", logger="stagerd.sinks.prune"):
        _publish(b, prefix, 4)
        assert _prune(prefix, b, 2) == {1: True, 2: True, 3: False, 4: False}
        kept = {s: _raw_keys(prefix, s) for s in (4, 5)}
        _publish(b, prefix, 5)
        assert _prune(prefix, b, 2) == {3: True, 4: False, 5: False}
    assert [_raw_keys(prefix, s) for s in (1, 2, 3)] == [set(), set(), set()]
    assert _raw_keys(prefix, 4) == kept[4] and len(kept[4]) == 4  # the file, marker, manifest, claim
    assert len(_raw_keys(prefix, 5)) == 4
    assert not [r.getMessage() for r in caplog.records if "another ROOT" in r.getMessage()]


def test_a_root_that_never_restored_still_leaves_the_resumed_runs_steps_alone(tmp_path, caplog):
    """The shared-prefix safety stays: C publishes to the prefix of the run A -> B by mistake, without a
    restore. B's retention prunes A's steps as its own and leaves C's; C's leaves A's and B's."""
    prefix = _Prefix(None, tmp_path, "file")  # type: ignore[arg-type]
    a, b, c = _root(tmp_path / "a"), tmp_path / "b", _root(tmp_path / "c")
    _publish(a, prefix, 1, 2)
    _restore(prefix, b)
    _publish(c, prefix, 7)
    _publish(b, prefix, 3, 4)
    with caplog.at_level("WARNING", logger="stagerd.sinks.prune"):
        assert _prune(prefix, b, 1) == {1: True, 2: True, 3: True, 4: False, 7: False}
    warned = [r.step for r in caplog.records if "another ROOT" in r.getMessage()]  # type: ignore[attr-defined]
    assert warned == [7]
    assert lineage.ancestors(c) == ()
    assert _prune(prefix, c, 1) == {4: False, 7: False}
    assert all(_raw_keys(prefix, s) for s in (4, 7))


def test_a_run_moved_twice_prunes_what_its_first_root_published(tmp_path):
    """A -> B -> C, each move a fresh ROOT and a restore. B's claims name A, whom B resumed from, so C's
    restore of B's step records both, and C's keep-last 1 prunes A's steps too. Before, C knew only B:
    A's steps were another publisher's to C and stayed for ever."""
    prefix = _Prefix(None, tmp_path, "file")  # type: ignore[arg-type]
    a, b, c = _root(tmp_path / "a"), tmp_path / "b", tmp_path / "c"
    _publish(a, prefix, 1, 2)
    _restore(prefix, b)
    _publish(b, prefix, 3)
    held = json.loads((tmp_path / "sink" / claim_key(f"raw/{layout.step_dir_name(3)}")).read_bytes())
    assert held["ancestors"] == [root_id(a)] and held["tree"] == root_id(b)
    _restore(prefix, c)
    assert lineage.ancestors(c) == (root_id(a), root_id(b))
    _publish(c, prefix, 4)
    assert _prune(prefix, c, 1) == {1: True, 2: True, 3: True, 4: False}
    assert [_raw_keys(prefix, s) for s in (1, 2, 3)] == [set(), set(), set()]
    claim_a = json.loads((tmp_path / "sink" / claim_key(f"raw/{layout.step_dir_name(4)}")).read_bytes())
    assert claim_a["ancestors"] == [root_id(a), root_id(b)]


@pytest.mark.parametrize("claim", ["missing", "unreadable"])
def test_a_restore_whose_claim_cannot_be_read_records_nothing_and_lands_the_step(tmp_path, claim):
    """No publisher to record (a stagerd before claims; a damaged claim): the restore lands the step, warns
    once that the earlier steps will not be pruned, and writes no lineage: retention keeps more, never
    less. A second restore from the same prefix then records the publisher it can read."""
    prefix = _Prefix(None, tmp_path, "file")  # type: ignore[arg-type]
    a, b = _root(tmp_path / "a"), tmp_path / "b"
    _publish(a, prefix, 1, 2)
    key = tmp_path / "sink" / claim_key(f"raw/{layout.step_dir_name(2)}")
    if claim == "missing":
        key.unlink()
    else:
        key.write_bytes(b"\x00not json")
    r = _restore(prefix, b)
    assert layout.is_committed(b / layout.step_dir_name(2))
    assert r.stderr.count("its publisher is not recorded") == 1, r.stderr
    assert not lineage.lineage_path(b).exists()
    r = run_cli(["restore", prefix.url, b, "--step", "1"], timeout=120)
    assert r.returncode == 0, r.stderr
    assert lineage.ancestors(b) == (root_id(a),)


def test_the_lineage_is_bounded_written_atomically_and_never_names_the_root_itself(tmp_path, monkeypatch):
    """The newest 64 ids stay, an id restored again moves to the end; a write that fails leaves the
    earlier file whole and no temp file; a restore of ROOT's own step (after its local copy went) adds
    nothing; a damaged file reads as no ancestors."""
    from stagerd.sinks import restored_from

    root = _root(tmp_path / "r")
    ids = [uuid.uuid4().hex for _ in range(70)]
    for i, id_ in enumerate(ids):
        assert lineage.record(root, id_, step=i, sink="file:///x")
    assert lineage.ancestors(root) == tuple(ids[-64:])
    lineage.record(root, ids[-30], step=99, sink="file:///x")
    assert lineage.ancestors(root) == (*(i for i in ids[-64:] if i != ids[-30]), ids[-30])
    before = lineage.lineage_path(root).read_bytes()

    def replace_fails(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", replace_fails)
    with pytest.raises(OSError):
        lineage.record(root, uuid.uuid4().hex, step=100, sink="file:///x")
    monkeypatch.undo()
    assert lineage.lineage_path(root).read_bytes() == before
    assert sorted(p.name for p in (root / layout.STATE_DIR).iterdir()) == ["lineage.json"]
    assert restored_from.record(root, 5, [root_id(root)], "file:///x") == []
    assert not lineage.record(root, "host:/not/an/id", step=5, sink="file:///x")
    assert lineage.lineage_path(root).read_bytes() == before
    lineage.lineage_path(root).write_text(json.dumps({"format": "other", "ancestors": ids}))
    assert lineage.ancestors(root) == ()


@pytest.mark.slow
def test_the_resumed_roots_daemon_prunes_the_earlier_roots_raw_steps(tmp_path, dcp_mixed2):
    """End to end: A's raw steps 1-3 on a file:// prefix; B restores the latest and its daemon, `watch
    --publish-raw --remote-keep-last 2 --once`, publishes 4 and 5: it says once that it counts A's steps,
    and only 4 and 5 remain raw, with no step left as another ROOT's."""
    import shutil

    from tests.daemon_helpers import fast_flags

    prefix = _Prefix(None, tmp_path, "file")  # type: ignore[arg-type]
    a, b = _root(tmp_path / "a"), tmp_path / "b"
    _publish(a, prefix, 1, 2, 3)
    _restore(prefix, b)
    for s in (4, 5):
        step_dir = b / layout.step_dir_name(s)
        shutil.copytree(dcp_mixed2[0], step_dir / "model")
        commit_step(step_dir, 2)
    args = ["watch", b, "--sink", prefix.url, "--publish-raw", "--remote-keep-last", "2", "--once"]
    r = run_cli([*args, *fast_flags()], timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    raw = tmp_path / "sink" / "raw"
    steps = sorted(s for p in raw.glob("step-*") if (s := layout.parse_step_dir(p.name)) is not None)
    assert steps == [4, 5], r.stderr[-3000:]
    assert r.stderr.count("1 earlier ROOT(s) this ROOT resumed from") == 1, r.stderr[-3000:]
    assert "another ROOT" not in r.stderr
