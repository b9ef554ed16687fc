"""A settings error reads as stagerd's, not pydantic's ('Value error, ' never shows), and its hint fits the
setting that failed: the JSON form only for a list or table setting given in the environment, the variable
to correct for any other setting given there."""

from __future__ import annotations

from pathlib import Path

import pytest

from stagerd.cli import main
from stagerd.daemon.settings_sources import load_settings
from stagerd.errors import ConfigError


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for k in list(os.environ):
        if k.startswith("STAGERD_"):
            monkeypatch.delenv(k)


def test_a_bad_scalar_variable_names_the_variable_not_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("STAGERD_DTYPE", "int8")
    monkeypatch.setenv("STAGERD_METRICS_PORT", "off")
    root = tmp_path / "root"
    root.mkdir()
    assert main(["watch", str(root), "--sink", (tmp_path / "sink").as_uri(), "--once"]) == 2
    err = capsys.readouterr().err
    assert "stagerd: ConfigError: invalid settings: dtype: unknown export dtype 'int8';" in err, err
    assert "Value error" not in err and "JSON" not in err, err
    assert "what to do: correct or unset STAGERD_DTYPE in the environment" in err, err


def test_a_bad_flag_over_a_good_variable_keeps_the_usual_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STAGERD_DTYPE", "bf16")
    with pytest.raises(ConfigError) as e:
        load_settings(dtype="int8")
    assert e.value.hint == ConfigError.hint and "Value error" not in e.value.message


def test_a_bad_list_variable_still_gets_the_json_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STAGERD_SINKS", "[broken")
    with pytest.raises(ConfigError) as e:
        load_settings()
    assert "STAGERD_SINKS='[\"s3://bucket/run\"]'" in e.value.hint


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"adopt": "nope"}, "invalid settings: adopt: must be one of auto|"),
        ({"adopt_select": "x"}, "invalid settings: adopt_select needs adopt (--adopt)"),
        ({"adopt": "auto", "delete_adopted": True}, "invalid settings: delete_adopted needs keep_last"),
        ({"adopt": "auto", "adopt_step": "(x"}, "invalid settings: adopt_step: "),
    ],
)
def test_adopt_errors_carry_no_pydantic_prefix(flags: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_settings(**flags)
    assert e.value.message.startswith(message), e.value.message
    assert "Value error" not in e.value.message and "settings: settings" not in e.value.message


def test_a_misspelt_preset_in_the_environment_names_the_closest(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--adopt hf_trainer` names hf-trainer; the same name from STAGERD_ADOPT or a TOML file did not."""
    monkeypatch.setenv("STAGERD_ADOPT", "hf_trainer")
    with pytest.raises(ConfigError, match=r"got 'hf_trainer'; did you mean hf-trainer\?"):
        load_settings(None, root="/tmp")
