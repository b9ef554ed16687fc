"""A ROOT that does not exist, where a directory beside it is named almost the same, is named with that
directory, as a misspelt sink or setting is: `mkdir -p` of the typo would start a daemon that waits
forever on an empty folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from stagerd.cli import main


@pytest.mark.parametrize(
    ("given", "meant"),
    [("outputs/checkpoint", "outputs/checkpoints"), ("outptus/checkpoints/run1", "outputs/checkpoints/run1")],
)
def test_a_misspelt_root_names_the_directory_it_resembles(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    given: str,
    meant: str,
) -> None:
    monkeypatch.setenv("STAGERD_METRICS_PORT", "off")
    (tmp_path / "outputs" / "checkpoints").mkdir(parents=True)
    (tmp_path / "outputs" / "logs").mkdir()
    sink = tmp_path / "sink"
    assert main(["watch", str(tmp_path / given), "--sink", sink.as_uri(), "--once"]) == 2
    err = capsys.readouterr().err
    assert "ROOT does not exist" in err, err
    assert (
        f"what to do: did you mean {tmp_path / meant}? Else create it (`mkdir -p {tmp_path / given}`)" in err
    )
    assert not (tmp_path / given).exists() and not sink.exists()


def test_a_root_like_nothing_beside_it_only_says_to_create_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STAGERD_METRICS_PORT", "off")
    (tmp_path / "outputs").mkdir()
    assert main(["watch", str(tmp_path / "run7"), "--sink", (tmp_path / "s").as_uri(), "--once"]) == 2
    err = capsys.readouterr().err
    assert f"what to do: create it (`mkdir -p {tmp_path / 'run7'}`)" in err, err
