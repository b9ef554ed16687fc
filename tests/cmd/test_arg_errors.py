"""A command line argparse refuses is said in one line and what to do, not argparse's usage block, and a
misspelt flag, command or choice names the one meant."""

from __future__ import annotations

import pytest

from stagerd.cli import main


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["watch", "r", "--sinks", "file:///x"],
            "stagerd watch: error: unrecognized arguments: --sinks (did you mean --sink?) file:///x",
        ),
        (
            ["--dbug", "status", "r"],
            "stagerd status: error: unrecognized arguments: --dbug (did you mean --debug?)",
        ),
        (["restor", "x"], "invalid choice: 'restor' (choose from 'watch', "),
        (["restor", "x"], "'demo'); did you mean restore?"),
        (["watch", "r", "--io-class", "idel"], "'none'); did you mean idle?"),
        (
            ["watch", "r", "--keep-last", "two"],
            "stagerd watch: error: argument --keep-last: invalid int value: 'two'",
        ),
        (
            ["watch", "r", "--dtype", "int8"],
            "stagerd watch: error: argument --dtype: unknown export dtype 'int8'",
        ),
    ],
)
def test_a_refused_command_line_is_one_line_and_what_to_do(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 2 and said in lines[0], err
    command = lines[0].split(": error:")[0]
    assert lines[1] == f"  what to do: see `{command} --help`", err
    assert "usage:" not in err
