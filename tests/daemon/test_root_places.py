"""ROOT and the local places others write, compared resolved (`daemon/root_places.py`): a ROOT reached
through a symlink into a sink's step directory, or inside the fleet exchange's own names, is refused by
`watch` before anything is written."""

from __future__ import annotations

from tests.cli_helpers import run_cli
from tests.daemon_helpers import fast_flags


def test_root_through_a_symlink_into_a_sinks_step_directory_is_refused(tmp_path):
    """`ROOT` -> `SINK/step-00000003`: the sink's publish of step 3 and its retention would write and
    delete inside the staged data; the link hides it only from a comparison of the names as written."""
    sink = tmp_path / "sink"
    (sink / "step-00000003").mkdir(parents=True)
    root = tmp_path / "root"
    root.symlink_to(sink / "step-00000003")
    (tmp_path / "sink-link").symlink_to(sink)
    for url in (sink.as_uri(), (tmp_path / "sink-link").as_uri()):
        r = run_cli(["watch", root, "--sink", url, "--once", *fast_flags()])
        assert r.returncode == 2, r.stderr
        said = f"ConfigError: ROOT {root} is inside sink {url!r}, under its step-00000003"
        assert said in r.stderr, r.stderr
        assert "nothing was written" in r.stderr
        assert list(root.iterdir()) == []  # no journal, no lock


def test_root_inside_a_file_exchanges_own_places_is_refused(tmp_path):
    """Before: only the sinks were compared with ROOT. With ROOT at `EXCHANGE/raw`, the fleet's raw part of
    step N would be written into ROOT's own `step-N`."""
    exchange = tmp_path / "exchange"
    root = exchange / "raw"
    root.mkdir(parents=True)
    sink = tmp_path / "sink"
    flags = ["--once", "--exchange", exchange.as_uri(), *fast_flags()]
    r = run_cli(["watch", root, "--sink", sink.as_uri(), *flags])
    assert r.returncode == 2, r.stderr
    assert f"ConfigError: ROOT {root} is inside exchange {exchange.as_uri()!r}, under its raw" in r.stderr
    assert list(root.iterdir()) == [] and not sink.exists()


def test_an_exchange_inside_a_sinks_raw_is_refused_before_anything_is_written(tmp_path):
    root, sink = tmp_path / "root", tmp_path / "sink"
    root.mkdir()
    exchange = (sink / "raw" / "x").as_uri()
    r = run_cli(["watch", root, "--sink", sink.as_uri(), "--exchange", exchange, "--once", *fast_flags()])
    assert r.returncode == 2, r.stderr
    said = f"ConfigError: exchange {exchange!r} lies inside sink {sink.as_uri()!r}, under its raw"
    assert said in r.stderr, r.stderr
    assert list(root.iterdir()) == [] and not sink.exists()


def test_a_file_exchange_in_a_step_directory_of_root_is_refused(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    exchange = root / "step-00000001"
    flags = ["--once", "--exchange", exchange.as_uri(), *fast_flags()]
    r = run_cli(["watch", root, "--sink", (tmp_path / "sink").as_uri(), *flags])
    assert r.returncode == 2, r.stderr
    assert f"ConfigError: exchange {exchange.as_uri()!r} is ROOT {root} or inside its step" in r.stderr
    assert list(root.iterdir()) == []
