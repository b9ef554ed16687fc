"""The tests' own house rules: small files, one way to run the CLI, one way to start gloo ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MAX_LINES = 450
SOURCES = sorted([*(REPO / "tests").rglob("*.py"), *(REPO / "bench").rglob("*.py")])


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(REPO)))
def test_each_test_and_bench_file_is_small(path: Path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(REPO)} has {lines} lines (at most {MAX_LINES})"


def _tests_mentioning(text: str) -> set[str]:
    return {
        str(p.relative_to(REPO))
        for p in (REPO / "tests").rglob("*.py")
        if p.name != Path(__file__).name and text in p.read_text()
    }


def test_only_the_cli_helper_builds_the_command_and_its_environment():
    assert _tests_mentioning('"stagerd.cli"') == {"tests/cli_helpers.py"}
    # test_no_torch hands the helper a PYTHONPATH of its own: a venv without torch, then this checkout.
    assert _tests_mentioning('"PYTHONPATH"') == {"tests/engine/test_no_torch.py"}
    assert _tests_mentioning("PYTHONPATH=") == {"tests/cli_helpers.py"}


def test_only_the_gloo_helper_spawns_ranks():
    assert _tests_mentioning("start_processes(") == {"tests/gloo.py"}
    # test_exit also runs one single-rank script as a user would, with no launcher at all.
    joined = {"tests/gloo.py", "tests/training/test_exit.py"}
    assert _tests_mentioning('init_process_group("gloo"') == joined
    # A rank that returns ends through tests.gloo.end_rank, not lines of its own; test_failures' rank dies
    # mid-save on purpose, and test_pid_namespaces' script is no rank.
    ended = {"tests/gloo.py", "tests/training/test_failures.py", "tests/sinks/test_pid_namespaces.py"}
    assert _tests_mentioning("os._exit(") == ended
