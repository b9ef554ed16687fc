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


def test_verify_names_the_step_directory_a_short_step_name_meant(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    step = tmp_path / "root" / "step-00000006"
    (step / "export").mkdir(parents=True)
    (tmp_path / "root" / "step-00000060").mkdir()
    cases = [
        (str(tmp_path / "root" / "step-6" / "export"), str(step / "export")),  # another zero padding
        ("root/step-006/export", "root/step-00000006/export"),  # relative stays relative
        (str(tmp_path / "rot" / "step-00000006" / "export"), str(step / "export")),  # a typo: the closest
    ]
    monkeypatch.chdir(tmp_path)
    for given, meant in cases:
        assert main(["verify", given]) != 0
        err = capsys.readouterr().err
        assert "EXPORT_DIR does not exist" in err and f"did you mean {meant}?" in err, (given, err)
    assert main(["verify", str(step / "export"), "--against", "root/step-6"]) != 0
    assert "--against does not exist" in (err := capsys.readouterr().err), err
    assert "did you mean root/step-00000006?" in err, err
    assert main(["verify", "root/step-7/export"]) != 0  # no step 7 and nothing alike: no guess
    assert "did you mean" not in (err := capsys.readouterr().err) and "check the path" in err, err
