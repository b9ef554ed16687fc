"""`stagerd --help` and each command's help speak to users: what it does, an example, nothing about the
source tree, and every line fits an 80-column terminal."""

from __future__ import annotations

import pytest

from tests.cli_helpers import run_cli

COMMANDS = ["", "watch", "status", "retry", "consolidate", "verify", "publish", "restore", "prune", "demo"]


@pytest.mark.parametrize("command", COMMANDS, ids=[c or "stagerd" for c in COMMANDS])
def test_help_speaks_to_users(command: str) -> None:
    proc = run_cli([*filter(None, [command]), "--help"], env={"COLUMNS": "80"})
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "examples:\n  stagerd " in text
    for developer_words in ("stagerd/cmd", "add_parser", ".py"):
        assert developer_words not in text
    assert all(len(line) <= 80 for line in text.splitlines()), text


def test_top_level_help_documents_sink_urls_and_exit_codes() -> None:
    text = run_cli(["--help"], env={"COLUMNS": "80"}).stdout.replace("\n", " ")
    assert "a bare /ABSOLUTE/PATH means the same" in text
    assert "Relative paths and memory:// are refused" in text
    assert "2 bad input or configuration" in text and "3 a failure that may pass on retry" in text
    assert "1 `watch --once` left a step unpublished" in text and "141 the reader" in text
