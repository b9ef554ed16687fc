"""tests/constraints.txt pins every requirement CI installs, inside the range pyproject.toml asks for; and
tests/floors.txt pins each dependency's floor exactly.

CI installs with `pip -c tests/constraints.txt`, which only narrows: a requirement the file does not pin
resolves through every release of the trainers' open ranges again (tens of minutes), and a pin outside a
requirement's range fails the install. Both come from editing pyproject.toml without regenerating the file
(`pip freeze --exclude-editable` in a venv where the suite passes). bench/compat_floors.sh installs
tests/floors.txt to run the floors the package claims (RELIABILITY.md, "Dependency floors"): a floor
raised in pyproject.toml alone would go untried.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def _pins(file: str = "constraints.txt") -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "tests" / file).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"{file}: {line!r} is not NAME==VERSION"
            pins[canonicalize_name(name)] = Version(version)
    return pins


def _requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    reqs = [Requirement(r) for r in [*project["dependencies"], *extras["train"], *extras["test"]]]
    return [r for r in reqs if canonicalize_name(r.name) != "stagerd"]


def test_every_requirement_is_pinned_in_its_range() -> None:
    pins = _pins()
    missing = [str(r) for r in _requirements() if canonicalize_name(r.name) not in pins]
    assert not missing, f"not pinned in tests/constraints.txt: {missing}"
    outside = [
        f"{r} (pinned {pins[canonicalize_name(r.name)]})"
        for r in _requirements()
        if not r.specifier.contains(pins[canonicalize_name(r.name)], prereleases=True)
    ]
    assert not outside, f"pinned outside pyproject.toml's range: {outside}"


def test_every_floor_is_pinned_in_floors_txt_at_its_version() -> None:
    floors = {}
    for dep in map(
        Requirement, tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    ):
        (low,) = [s.version for s in dep.specifier if s.operator == ">="]
        floors[canonicalize_name(dep.name)] = Version(low)
    assert _pins("floors.txt") == floors
