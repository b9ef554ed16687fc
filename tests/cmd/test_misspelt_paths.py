"""A path a user mistyped (a ROOT, a step directory) is named with the directory it resembles, as the
daemon's own start names a misspelt ROOT: "does not exist" alone leaves the user to find it."""

from __future__ import annotations

from pathlib import Path

import pytest

from stagerd.cli import main


@pytest.mark.parametrize("command", ["status", "retry"])
def test_status_and_retry_name_the_root_a_typo_meant(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    (tmp_path / "run" / "root").mkdir(parents=True)
    assert main([command, str(tmp_path / "run" / "rot")]) != 0
    err = capsys.readouterr().err
    assert "ROOT does not exist" in err, err
    assert f"did you mean {tmp_path / 'run' / 'root'}? Else give the ROOT" in err, err
    assert main([command, str(tmp_path / "run" / "elsewhere")]) != 0  # nothing alike: no guess
    err = capsys.readouterr().err
    assert "did you mean" not in err and "give the ROOT `stagerd watch` runs on" in err, err
