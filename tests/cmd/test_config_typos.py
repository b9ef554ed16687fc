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
