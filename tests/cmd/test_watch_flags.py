"""Every `watch` flag given wrongly is a one-line ConfigError (exit 2) before anything is created (issue 16's
red team): negative, zero and absurdly large numbers, a regex that does not compile, a size that is not
one. A number past the bounds would otherwise mean 10^20 worker threads or a timer beyond time_t."""

from __future__ import annotations

from pathlib import Path

import pytest

from stagerd.cli import main

HUGE = "99999999999999999999"
WRONG = [
    ("--keep-last", "-1"),
    ("--keep-last", HUGE),
    ("--export-workers", "0"),
    ("--export-workers", HUGE),
    ("--publish-workers", "100000"),
    ("--max-attempts", "0"),
    ("--max-attempts", HUGE),
    ("--rescan-seconds", "-1"),
    ("--rescan-seconds", "0"),
    ("--rescan-seconds", "nan"),
    ("--rescan-seconds", "1e300"),
    ("--grace-seconds", "-5"),
    ("--grace-seconds", "1e300"),
    ("--nice", "100"),
    ("--nice", "-5"),
    ("--keep-dtype", "(["),
    ("--max-shard-size", "0"),
    ("--max-shard-size", "5XB"),
    ("--metrics-port", "70000"),
    ("--metrics-port", "-1"),
]


@pytest.mark.parametrize(("flag", "value"), WRONG, ids=[f"{f}={v}" for f, v in WRONG])
def test_a_wrong_watch_flag_is_a_config_error_and_creates_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, flag: str, value: str
) -> None:
    monkeypatch.setenv("STAGERD_METRICS_PORT", "off")
    root, sink = tmp_path / "root", tmp_path / "sink"
    root.mkdir()
    assert main(["watch", str(root), "--sink", sink.as_uri(), "--once", flag, value]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("stagerd:")]
    assert len(lines) == 1 and lines[0].startswith("stagerd: ConfigError: "), err
    assert flag.removeprefix("--").replace("-", "_") in lines[0]
    assert "what to do:" in err and "Traceback" not in err
    assert list(root.iterdir()) == [] and not sink.exists()
