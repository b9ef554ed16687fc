"""A step's marker is read at most to its 64 MiB limit, and never from a FIFO: by `read_marker` and by
`marker_identity` (the fleet, retention and restore ask which save a step holds)."""

from __future__ import annotations

import os

import pytest

from stagerd.contract import commit_marker, layout
from stagerd.errors import MarkerError


@pytest.mark.parametrize("read", [commit_marker.read_marker, commit_marker.marker_identity])
def test_a_huge_or_fifo_marker_is_a_marker_error(tmp_path, read):
    huge = tmp_path / "step-00000001"
    huge.mkdir()
    with open(huge / layout.MARKER_NAME, "wb") as f:
        f.truncate(1 << 40)  # sparse: before, read whole (MemoryError) by marker_identity
    with pytest.raises(MarkerError, match="larger than 64 MiB"):
        read(huge)
    fifo = tmp_path / "step-00000002"
    fifo.mkdir()
    os.mkfifo(fifo / layout.MARKER_NAME)  # before: marker_identity waited for a writer for good
    with pytest.raises(MarkerError, match="cannot read"):
        read(fifo)
