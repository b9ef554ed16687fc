"""How `tests.gloo.launch` ends its ranks: a rank that returns skips the interpreter's teardown (where a
thread torch left behind aborts one now and then) unless the test asks for it, and a rank that raises
still fails the launch with its own error, its peer ending without a hang."""

from __future__ import annotations

import atexit
from pathlib import Path

import pytest

from tests.gloo import join, launch


def _marks_its_exit(rank: int, world: int, init_file: str, out: str) -> None:
    atexit.register(Path(out, f"exit{rank}").write_text, "teardown ran")


def test_a_rank_that_returns_skips_the_interpreters_teardown_unless_asked(tmp_path):
    (tmp_path / "ended").mkdir()
    launch(_marks_its_exit, str(tmp_path / "ended"), world=1)
    assert not (tmp_path / "ended" / "exit0").exists()
    launch(_marks_its_exit, str(tmp_path), world=1, teardown=True)
    assert (tmp_path / "exit0").read_text() == "teardown ran"


def _one_rank_raises(rank: int, world: int, init_file: str) -> None:
    join(rank, world, init_file)
    if rank == 1:
        raise ValueError("rank 1 failed after joining")


def test_a_rank_that_raises_fails_the_launch_with_its_error_while_its_peer_ends(tmp_path):
    with pytest.raises(Exception, match="rank 1 failed after joining"):
        launch(_one_rank_raises, world=2, deadline_s=60)
