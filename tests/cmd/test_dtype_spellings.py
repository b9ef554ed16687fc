"""An export dtype is accepted as torch and transformers spell it (`bfloat16`, `half`, `float`, any case)
wherever it is given, flag, variable or TOML key, and stored as its short form, as a save's is."""

from __future__ import annotations

from pathlib import Path

import pytest

from stagerd.cli import build_parser, main
from stagerd.contract.dtypes import normalise_export_dtype, parse_export_dtype
from stagerd.daemon.settings_sources import load_settings

SPELLINGS = [
    ("bfloat16", "bf16"),
    ("BFloat16", "bf16"),
    ("BF16", "bf16"),
    ("float16", "fp16"),
    ("half", "fp16"),
    ("float32", "fp32"),
    ("Float", "fp32"),
    ("KEEP", "keep"),
]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for k in list(os.environ):
        if k.startswith("STAGERD_"):
            monkeypatch.delenv(k)


@pytest.mark.parametrize(("given", "short"), SPELLINGS)
def test_every_spelling_is_one_normaliser_s(given: str, short: str) -> None:
    assert normalise_export_dtype(given) == short
    assert parse_export_dtype(given) == parse_export_dtype(short)  # what consolidate's --dtype casts to


@pytest.mark.parametrize(("given", "short"), SPELLINGS)
def test_the_watch_flag_the_variable_and_the_toml_key_take_every_spelling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: str, short: str
) -> None:
    args = build_parser().parse_args(["watch", str(tmp_path), "--dtype", given])
    assert load_settings(None, dtype=args.dtype).dtype == short
    cfg = tmp_path / "stagerd.toml"
    cfg.write_text(f'dtype = "{given}"\n')
    assert load_settings(cfg).dtype == short
    monkeypatch.setenv("STAGERD_DTYPE", given)
    assert load_settings().dtype == short


def test_watch_once_runs_with_a_torch_spelling(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STAGERD_METRICS_PORT", "off")
    root = tmp_path / "root"
    root.mkdir()
    argv = ["watch", str(root), "--sink", (tmp_path / "sink").as_uri(), "--once", "--dtype", "bfloat16"]
    assert main(argv) == 0, capsys.readouterr().err


def test_an_unknown_dtype_is_still_refused_with_the_spellings_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from stagerd.errors import ConfigError

    monkeypatch.setenv("STAGERD_DTYPE", "int8")
    with pytest.raises(ConfigError) as e:
        load_settings()
    assert "unknown export dtype 'int8'; use one of keep|bf16|fp16|fp32 (or bfloat16," in e.value.message
    with pytest.raises(SystemExit):
        build_parser().parse_args(["watch", "r", "--dtype", "int8"])
