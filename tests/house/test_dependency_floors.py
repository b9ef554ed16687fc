"""tests/floors.txt pins each of pyproject.toml's dependency floors exactly, so bench/compat_floors.sh runs
the floors the package claims (RELIABILITY.md, "Dependency floors")."""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]


def test_every_floor_is_pinned_in_floors_txt_at_its_version():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    floors = {}
    for dep in map(Requirement, deps):
        (low,) = [s.version for s in dep.specifier if s.operator == ">="]
        floors[canonicalize_name(dep.name)] = Version(low)
    pinned = {}
    for line in (REPO / "tests" / "floors.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pinned[canonicalize_name(name)] = Version(version)
    assert pinned == floors
