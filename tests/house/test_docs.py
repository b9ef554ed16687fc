"""The documents name files that exist: a moved or renamed module or test leaves no stale path behind."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = ["README.md", "ARCHITECTURE.md", "RELIABILITY.md", "BENCHMARKS.md"]
# A source file named from the repository's root. Paths relative to a folder the prose is about
# (`fleet/node.py` in the daemon's paragraph), directories on a user's machine (`/etc/stagerd/`) and what
# a benchmark writes (`bench/out/`) are left to the reader.
CITED = re.compile(
    r"(?<![\w/])(?:stagerd|tests|bench|examples|systemd|docker)/[\w/.-]*\.(?:py|c|txt|toml|service|sh)\b"
)


@pytest.mark.parametrize("doc", DOCS)
def test_every_cited_path_exists(doc: str):
    text = (REPO / doc).read_text()
    missing = sorted({p for p in CITED.findall(text) if not (REPO / p).exists()})
    assert missing == [], f"{doc} names files that do not exist: {missing}"


def test_every_crash_and_delay_point_is_documented():
    """`ops/crashpoints.py` promises each of its points a place in RELIABILITY.md."""
    from stagerd.ops.crashpoints import DELAYS, POINTS

    text = (REPO / "RELIABILITY.md").read_text()
    missing = sorted(p for p in {*POINTS, *DELAYS} if f"`{p}`" not in text)
    assert missing == [], f"RELIABILITY.md never names the points {missing}"
