"""A ROOT's fleet identity (`ROOT/.stagerd/fleet-root-id`) stays with that ROOT directory: the same across
restarts, and a new one in a copy of it (`cp -a`, a node image), so that two ROOTs never claim one node
of a step as the same ROOT."""

from __future__ import annotations

import logging
import shutil
import socket
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from stagerd.daemon.fleet.tasks import FleetTasks
from stagerd.daemon.root_places import claim_export_dir
from stagerd.errors import ConfigError


def _id(root: Path) -> str:
    return FleetTasks._fleet_root_id(SimpleNamespace(root=root))  # the method reads `root` alone


def _root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    (root / ".stagerd").mkdir(parents=True)
    return root


def test_a_copied_root_gets_its_own_identity_and_the_original_keeps_its(tmp_path, caplog):
    """`cp -a ROOT` used to carry `fleet-root-id` along: both ROOTs then claimed node K of a step as one
    ROOT, and both built and uploaded its files (and shared one --export-dir). A ROOT moved with `mv`
    keeps its identity."""
    root = _root(tmp_path)
    first = _id(root)
    clone = tmp_path / "clone"
    shutil.copytree(root, clone, symlinks=True)
    with caplog.at_level(logging.WARNING, "stagerd.fleet"):
        copied = _id(clone)
        assert _id(clone) == copied  # made once: later restarts of the copy keep the new one
    assert copied != first and _id(root) == first
    moved = tmp_path / "moved"
    root.rename(moved)  # `mv` within a filesystem: the same directory
    assert _id(moved) == first
    moved.rename(root)
    warned = [r for r in caplog.records if "taken for a copy" in r.getMessage()]
    assert len(warned) == 1 and str(clone) in warned[0].getMessage()
    claim_export_dir(root, tmp_path / "exports", first)
    with pytest.raises(ConfigError, match="holds the exports of another ROOT"):  # one --export-dir, two ROOTs
        claim_export_dir(clone, tmp_path / "exports", copied)


def test_a_root_whose_host_is_renamed_keeps_its_identity(tmp_path, monkeypatch, caplog):
    """A pod recreated under a new name on the same node-local ROOT (same directory, another host name)
    is the same ROOT: its in-flight fleet steps stay its own."""
    root = _root(tmp_path)
    first = _id(root)
    monkeypatch.setattr(socket, "gethostname", lambda: "another-pod")
    with caplog.at_level(logging.WARNING, "stagerd.fleet"):
        assert _id(root) == first
    assert not caplog.records


def test_an_identity_made_by_an_older_stagerd_is_kept(tmp_path, caplog):
    """An older stagerd wrote the id alone: it is this ROOT's, and it is kept (without a warning)."""
    root = _root(tmp_path)
    old = uuid.uuid4().hex
    (root / ".stagerd" / "fleet-root-id").write_text(old)
    with caplog.at_level(logging.WARNING, "stagerd.fleet"):
        assert _id(root) == old and _id(root) == old
    assert not caplog.records


def test_two_processes_making_the_first_identity_agree_on_one(tmp_path, monkeypatch):
    """The daemon and a `stagerd publish` starting together both found no id: each wrote its own, the last
    one won, and the other's claims (which name the id) read as foreign. The first id is created only
    where none is, so the later process takes the id already there."""
    from stagerd.contract import root_id as rid

    root = _root(tmp_path)
    path = root / ".stagerd" / rid.ROOT_ID_NAME
    theirs = uuid.uuid4().hex
    real_read = Path.read_text

    def read_then_lose_the_race(self: Path, *a, **k) -> str:
        if self == path and not path.exists():
            rid._write(path, theirs, rid.where(root))  # the other process, right after this one's read
            raise FileNotFoundError(path)
        return real_read(self, *a, **k)

    monkeypatch.setattr(Path, "read_text", read_then_lose_the_race)
    assert rid.root_id(root) == theirs
    assert rid._parse(real_read(path).strip())["id"] == theirs
