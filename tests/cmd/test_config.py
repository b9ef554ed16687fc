"""Settings precedence (TOML < STAGERD_* < flags), validation, and that every setting is documented."""

from __future__ import annotations

import pytest

from stagerd.config import Settings, settings_table
from stagerd.daemon.settings_sources import load_settings
from stagerd.errors import ConfigError


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for k in list(os.environ):
        if k.startswith("STAGERD_"):
            monkeypatch.delenv(k)


def test_defaults():
    s = load_settings()
    assert s.sinks == [] and s.keep_last is None and s.once is False
    assert (s.nice, s.io_class) == (10, "idle")
    assert (s.metrics_host, s.metrics_port) == ("127.0.0.1", 9464)
    assert s.max_shard_size is None and s.shard_size() == 50_000_000_000  # save_pretrained's


def test_a_fleet_step_packs_smaller_files_by_default_whether_or_not_an_exchange_is_given():
    """The nodes of a fleet share the work by output file: 50GB files would leave a model under 50GB to
    one node. The nodes meet on the first fsspec sink when no exchange is given: 5GB files all the same."""
    on_sink = load_settings(None, sinks=["s3://b/run"])
    assert on_sink.shard_size() == 50_000_000_000  # a step staged on one node: save_pretrained's
    assert on_sink.shard_size(fleet=True) == 5_000_000_000
    assert load_settings(None, sinks=["s3://b/run"], exchange="s3://b/x").shard_size() == 5_000_000_000
    given = load_settings(None, sinks=["s3://b/run"], max_shard_size="2GB")
    assert given.shard_size(fleet=True) == given.shard_size() == 2_000_000_000


def test_toml_then_env_then_flags(tmp_path, monkeypatch):
    cfg = tmp_path / "stagerd.toml"
    cfg.write_text(
        'sinks = ["file:///from-toml"]\nkeep_last = 3\ndtype = "fp16"\n'
        'grace_seconds = 5\nmax_shard_size = "2GB"\n'
    )
    s = load_settings(cfg)
    assert (s.sinks, s.keep_last, s.dtype, s.grace_seconds) == (["file:///from-toml"], 3, "fp16", 5.0)
    assert s.max_shard_size == 2_000_000_000

    monkeypatch.setenv("STAGERD_KEEP_LAST", "4")
    monkeypatch.setenv("STAGERD_SINKS", "file:///e1, s3://b/p")
    s = load_settings(cfg)
    assert (s.sinks, s.keep_last, s.dtype) == (["file:///e1", "s3://b/p"], 4, "fp16")

    s = load_settings(cfg, keep_last=7, dtype=None, sinks=["hf://org/repo"])
    assert (s.sinks, s.keep_last, s.dtype) == (["hf://org/repo"], 7, "fp16")  # None flags do not override


def test_env_accepts_a_json_list_and_port_off(monkeypatch):
    monkeypatch.setenv("STAGERD_SINKS", '["file:///a", "file:///b"]')
    monkeypatch.setenv("STAGERD_METRICS_PORT", "off")
    s = load_settings()
    assert s.sinks == ["file:///a", "file:///b"] and s.metrics_port == 0


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        ({"dtype": "int8"}, "unknown export dtype 'int8'; use one of keep|bf16"),
        ({"keep_last": -1}, "keep_last"),
        ({"keep_dtype": "(unclosed"}, "keep_dtype"),
        ({"io_class": "realtime"}, "io_class"),
        ({"metrics_port": 70000}, "metrics_port"),
        ({"max_shard_size": "lots"}, "max_shard_size"),
        ({"exchange": "file://relative/x"}, "relative path"),  # was taken, under the daemon's cwd
        ({"exchange": "hf://org/repo"}, "not the Hub"),
        ({"exchange": "s3://b/run*"}, "glob"),
        ({"adopt": "auto", "delete_adopted": True}, "delete_adopted needs keep_last"),  # deleted nothing
    ],
)
def test_bad_values_are_config_errors(flags, match):
    with pytest.raises(ConfigError, match=match):
        load_settings(**flags)


def test_an_exchange_url_error_names_the_exchange_not_a_sink():
    with pytest.raises(ConfigError) as e:
        load_settings(exchange="file://relative/x", sinks=["file:///tmp/out"])
    assert str(e.value).startswith("--exchange URL 'file://relative/x'"), str(e.value)
    with pytest.raises(ConfigError, match=r"^sink URL 'file://relative/x'"):  # a sink's says sink
        load_settings(sinks=["file://relative/x"])


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("file:///srv/out", "/srv/out"),
        ("/srv/out/", "file:///srv/out"),
        ("s3://bkt/run1", "s3a://bkt/run1/"),
        ("hf://org/repo", "hf://org/repo?private=true"),
        ("/srv/out", "/srv/out"),
    ],
)
def test_two_spellings_of_one_sink_are_refused_naming_both(first, second):
    # two lanes to one place: each step written there twice, by two publishes at once
    with pytest.raises(ConfigError) as e:
        load_settings(sinks=[first, second])
    assert repr(first) in str(e.value) and repr(second) in str(e.value), str(e.value)


def test_different_places_are_not_duplicates():
    sinks = ["file:///srv/out", "/srv/out2", "s3://bkt/run1", "s3://bkt/run10", "hf://org/repo@dev"]
    sinks += ["s3://other/run1/sub", "ftp://host/run1/sub"]  # same prefixes, another bucket or store
    assert load_settings(sinks=[*sinks, "hf://org/repo"]).sinks == [*sinks, "hf://org/repo"]


@pytest.mark.parametrize(
    ("outer", "inner"),
    [
        ("file:///srv/out", "file:///srv/out/step-00000100"),
        ("/srv/out", "file:///srv/out/raw/b"),
        ("s3://bkt/run1", "s3://bkt/run1/claims"),
        ("s3a://bkt/run1/", "s3://bkt/run1/fleet/deeper"),
        ("s3://bkt", "s3://bkt/restoring"),  # the whole bucket is a sink at the bucket's top
        ("ftp://host/run1", "ftp://host/run1/latest"),
    ],
)
def test_a_sink_inside_another_sinks_own_places_is_refused_naming_both(outer, inner):
    # the outer sink's listings and retention would meet the inner one's files; either order is refused
    for sinks in ([outer, inner], [inner, outer]):
        with pytest.raises(ConfigError, match="lies inside sink") as e:
            load_settings(sinks=sinks)
        assert f"sink {inner!r} lies inside sink {outer!r}, under its " in str(e.value), str(e.value)
        assert "side by side" in e.value.hint


def test_a_sink_in_another_folder_of_a_sink_is_its_own():
    """A sink touches only its steps, raw/, claims/, fleet/, restoring/ and latest: a sink in any other
    folder of it (a layout that ran before nesting was checked) meets none of its files."""
    sinks = ["file:///srv/out", "file:///srv/out/sub", "s3://bkt/run1", "s3://bkt/run1/sub/deeper"]
    sinks += ["s3://whole", "s3://whole/run1", "file:///srv/out/stepping"]
    assert load_settings(sinks=sinks).sinks == sinks


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_settings(tmp_path / "missing.toml")
    typo = tmp_path / "typo.toml"
    typo.write_text("keep_lats = 3\n")
    with pytest.raises(ConfigError, match="keep_lats"):
        load_settings(typo)
    broken = tmp_path / "broken.toml"
    broken.write_text("sinks = [\n")
    with pytest.raises(ConfigError, match=r"broken\.toml"):
        load_settings(broken)


def test_every_setting_is_documented():
    rows = settings_table()
    assert [r[0] for r in rows] == list(Settings.model_fields)
    for name, env, _default, description in rows:
        assert env == f"STAGERD_{name.upper()}"
        assert len(description) > 15, name


def test_a_misspelt_variable_is_named_not_ignored_in_silence(monkeypatch, caplog):
    monkeypatch.setenv("STAGERD_SINK", "file:///srv/a")  # STAGERD_SINKS meant: it would publish nowhere
    monkeypatch.setenv("STAGERD_TEST_PAUSE_AT", "export")  # a test hook, not a setting: no warning
    with caplog.at_level("WARNING", logger="stagerd"):
        s = load_settings()
    assert s.sinks == []
    warned = [r.getMessage() for r in caplog.records]
    assert "STAGERD_SINK is not a stagerd setting and is ignored (did you mean STAGERD_SINKS?)" in warned
    assert not any("STAGERD_TEST_PAUSE_AT" in w for w in warned)


@pytest.mark.parametrize(
    ("sink", "exchange", "said"),
    [
        (
            "s3://bkt/run1",
            "s3://bkt/run1/raw/x",
            "exchange 's3://bkt/run1/raw/x' lies inside sink 's3://bkt/run1'",
        ),
        ("/srv/out", "file:///srv/out/fleet", "exchange 'file:///srv/out/fleet' lies inside sink '/srv/out'"),
        ("s3://bkt/x/raw", "s3a://bkt/x/", "sink 's3://bkt/x/raw' lies inside exchange 's3a://bkt/x/'"),
        ("s3://bkt/x/fleet/a", "s3://bkt/x", "sink 's3://bkt/x/fleet/a' lies inside exchange 's3://bkt/x'"),
        ("file:///srv/x/export", "file:///srv/x", "sink 'file:///srv/x/export' lies inside exchange"),
    ],
)
def test_an_exchange_among_a_sinks_own_places_or_a_sink_among_its_is_refused(sink, exchange, said):
    """Before: the exchange was never compared with the sinks. The fleet writes `raw/step-N/node-K-of-M/`
    and `fleet/step-N/` on the exchange: a sink's steps there, or the exchange in a sink's `raw/`, would meet
    under the same names."""
    with pytest.raises(ConfigError, match="lies inside") as e:
        load_settings(sinks=["hf://org/repo", sink], exchange=exchange)
    assert said in str(e.value), str(e.value)
    assert "--exchange" in e.value.hint and "nothing was written" in e.value.hint


def test_an_exchange_through_a_symlink_into_a_sinks_raw_is_refused(tmp_path):
    (tmp_path / "sink" / "raw").mkdir(parents=True)
    (tmp_path / "alias").symlink_to(tmp_path / "sink" / "raw")
    with pytest.raises(ConfigError, match="under its raw"):
        load_settings(sinks=[(tmp_path / "sink").as_uri()], exchange=(tmp_path / "alias").as_uri())


def test_an_exchange_on_a_sink_or_beside_the_sinks_is_allowed():
    """A sink's very place is the default exchange (the first fsspec sink: its `raw/` and `fleet/` are laid
    out to be shared), so naming it, or another sink, is allowed; so are folders the other does not use."""
    for sinks, exchange in [
        (["s3://bkt/run1", "s3://bkt/run2"], "s3a://bkt/run2/"),
        (["s3://bkt/run1"], "s3://bkt/exchange"),
        (["s3://bkt/run1"], "s3://bkt/run1/exchange"),
        (["s3://bkt/x/sinks/run1", "hf://org/repo"], "s3://bkt/x"),
        (["hf://org/repo"], "s3://bkt/x"),
    ]:
        assert load_settings(sinks=sinks, exchange=exchange).exchange == exchange
