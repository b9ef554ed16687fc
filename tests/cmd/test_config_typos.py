"""A TOML key that is not a setting: `stagerd watch --config FILE` refuses it (exit 2) and names the
closest setting, as it does for a `STAGERD_*` variable, rather than pydantic's 'Extra inputs are not
permitted' (the real CLI on a real file)."""

from __future__ import annotations

from tests.cli_helpers import run_cli


def test_a_misspelt_toml_key_names_the_setting_it_resembles(tmp_path):
    cfg = tmp_path / "stagerd.toml"
    cfg.write_text(f'root = "{tmp_path / "root"}"\nkeep_lats = 3\nflavour = "x"\nonce = true\n')
    proc = run_cli(["watch", "--config", cfg])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "keep_lats: not a setting (did you mean keep_last?)" in proc.stderr, proc.stderr
    assert "flavour: not a setting;" in proc.stderr or "flavour: not a setting\n" in proc.stderr, proc.stderr
    assert "Extra inputs" not in proc.stderr
    assert not (tmp_path / "root").exists()


def test_a_bad_value_still_says_what_is_wrong_with_it(tmp_path):
    cfg = tmp_path / "stagerd.toml"
    cfg.write_text(f'root = "{tmp_path / "root"}"\nkeep_last = "many"\n')
    proc = run_cli(["watch", "--config", cfg])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "keep_last:" in proc.stderr and "not a setting" not in proc.stderr, proc.stderr


def test_a_variable_that_is_not_json_or_a_file_that_is_not_toml_is_named_with_its_form(tmp_path, monkeypatch):
    """Before: 'error parsing value for field "sink_retention" from source "EnvSettingsSource"', naming
    neither the variable nor the form it takes, and a YAML file's TOML parse error as it came."""
    import pytest

    from stagerd.daemon.settings_sources import load_settings
    from stagerd.errors import ConfigError

    monkeypatch.setenv("STAGERD_SINK_RETENTION", "last=3")
    with pytest.raises(ConfigError) as e:
        load_settings(root=str(tmp_path))
    assert e.value.message == "STAGERD_SINK_RETENTION is not JSON: 'last=3'", e.value.message
    assert '{"s3://bucket/run": "last=3"}' in e.value.hint
    monkeypatch.delenv("STAGERD_SINK_RETENTION")

    monkeypatch.setenv("STAGERD_SINKS", "[broken")
    with pytest.raises(ConfigError, match="sinks: ") as e:
        load_settings(root=str(tmp_path))
    assert "STAGERD_SINKS='[\"s3://bucket/run\"]'" in e.value.hint
    monkeypatch.delenv("STAGERD_SINKS")

    yaml = tmp_path / "stagerd.yaml"
    yaml.write_text("sinks:\n  - file:///x\n")
    with pytest.raises(ConfigError, match="not a TOML file") as e:
        load_settings(yaml)
    assert "in TOML" in e.value.hint
