"""Sinks are compared by where they write, resolved (`sinks/places.py`): a file:// sink named through a
symlink is where the link leads, `hf://ORG/REPO` is its `@main`, and an S3 prefix is the keys it writes."""

from __future__ import annotations

import pytest

from stagerd.daemon.settings_sources import load_settings
from stagerd.errors import ConfigError
from stagerd.sinks.fsspec import FsspecSink
from tests import s3server
from tests.cmd.test_cmd_publish import make_export

s3_server, s3 = s3server.s3_server, s3server.s3  # the fixtures


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for k in list(os.environ):
        if k.startswith("STAGERD_"):
            monkeypatch.delenv(k)


def test_a_file_sink_through_a_symlink_is_the_same_place_as_its_target(tmp_path):
    """Before: compared as written, `file:///t/link` and `file:///t/data` were two lanes publishing every
    step into one directory at once. A sink directory not created yet is resolved through its parent."""
    (tmp_path / "data").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "data")
    (tmp_path / "hop").symlink_to(tmp_path / "link")  # a link to a link
    pairs = [
        ((tmp_path / "data").as_uri(), (tmp_path / "link").as_uri()),
        (str(tmp_path / "data" / "run"), (tmp_path / "hop" / "run").as_uri() + "/"),  # "run" is not made yet
    ]
    for first, second in pairs:
        with pytest.raises(ConfigError, match="are the same place") as e:
            load_settings(sinks=[first, second])
        assert f"sinks {first!r} and {second!r}" in str(e.value), str(e.value)
        assert not (tmp_path / "data" / "run").exists()
    # another directory beside the target is another place
    other = [(tmp_path / "data").as_uri(), (tmp_path / "link-sibling").as_uri()]
    assert load_settings(sinks=other).sinks == other


@pytest.mark.parametrize("own", ["raw", "step-00000007", "claims", "latest"])
def test_a_sink_through_a_symlink_into_another_sinks_own_places_is_refused(tmp_path, own):
    """Before: `file:///t/alias/x` with `alias` -> `out/raw` was not seen inside `file:///t/out`'s `raw/`,
    where the outer sink's raw publishes and retention would meet the inner sink's steps."""
    outer = tmp_path / "out"
    (outer / own).mkdir(parents=True)
    (tmp_path / "alias").symlink_to(outer / own)
    inner = (tmp_path / "alias" / "x").as_uri()
    for sinks in ([outer.as_uri(), inner], [inner, outer.as_uri()]):
        with pytest.raises(ConfigError, match="lies inside sink") as e:
            load_settings(sinks=sinks)
        assert f"sink {inner!r} lies inside sink {outer.as_uri()!r}, under its {own}" in str(e.value)
        assert "side by side" in e.value.hint
    # and the outer sink named through a link to it, the inner one as it is
    (tmp_path / "outer-link").symlink_to(outer)
    with pytest.raises(ConfigError, match="lies inside sink"):
        load_settings(sinks=[(tmp_path / "outer-link").as_uri(), (outer / own / "y").as_uri()])


def test_a_link_into_another_folder_of_a_sink_is_its_own_place(tmp_path):
    outer = tmp_path / "out"
    (outer / "sub").mkdir(parents=True)
    (tmp_path / "alias").symlink_to(outer / "sub")
    sinks = [outer.as_uri(), (tmp_path / "alias").as_uri()]
    assert load_settings(sinks=sinks).sinks == sinks


def test_a_hub_repo_without_a_revision_is_its_main():
    """The Hub sink publishes `hf://ORG/REPO` to `main` (`HubSink.revision`): before, it and
    `hf://ORG/REPO@main` were two lanes committing each step twice to one branch."""
    with pytest.raises(ConfigError, match="are the same place") as e:
        load_settings(sinks=["hf://org/repo", "hf://org/repo@main?private=true"])
    assert "'hf://org/repo' and 'hf://org/repo@main?private=true'" in str(e.value)
    sinks = ["hf://org/repo", "hf://org/repo@dev", "hf://org/other@main", "hf://org/repo@Dev"]
    assert load_settings(sinks=sinks).sinks == sinks


def test_a_hub_repo_id_in_another_case_is_the_same_repo():
    """The Hub finds a repo whatever the case of its id, so `hf://Org/Repo` and `hf://org/repo` would be two
    lanes committing each step twice to one branch; a revision is a git ref, whose case counts (above)."""
    with pytest.raises(ConfigError, match="are the same place"):
        load_settings(sinks=["hf://Org/Repo", "hf://org/repo@main"])


def test_s3_spellings_are_one_place_exactly_when_they_write_the_same_keys(s3, tmp_path):
    """`s3://B/run/` and `s3a://B/run` write under `run/` (s3fs strips the slash), so they are one sink;
    keys are case-sensitive, so `s3://B/Run` is another place and stays allowed."""
    export = make_export(tmp_path / "export")
    for url in (s3.url("run/"), f"s3a://{s3.bucket}/run", s3.url("Run")):
        sink = FsspecSink.from_url(url)
        try:
            sink.publish(export, 1)
        finally:
            sink.close()
    keys = s3.keys()
    assert keys and all(k.split("/", 1)[0] in ("run", "Run") for k in keys), sorted(keys)
    assert {k.removeprefix("Run/") for k in keys if k.startswith("Run/")} == {
        k.removeprefix("run/") for k in keys if k.startswith("run/")
    }
    with pytest.raises(ConfigError, match="are the same place"):
        load_settings(sinks=[s3.url("run/"), f"s3a://{s3.bucket}/run"])
    assert load_settings(sinks=[s3.url("run"), s3.url("Run")]).sinks == [s3.url("run"), s3.url("Run")]
