"""A `file://` sink's path: a file there, or above it, is bad input; a link leading nowhere is an outage.

A sink directory that is a regular file, or lies under one, was retried for ever by the daemon as a sink
that is down (`NotADirectoryError`), and `prune` or `restore` of one failed as one (exit 3). It is a
`ConfigError` naming the file wherever a sink is opened or its place resolved, before anything is
written: `watch`, `publish`, `prune` and `restore` exit 2. A sink reached through a link whose target is
gone (its filesystem not mounted) is what a sink going down looks like: retried, read as down rather
than empty, nothing made where the link leads, and published once the target is there again."""

from __future__ import annotations

import os

import pytest

from stagerd.contract import layout
from stagerd.errors import ConfigError, SinkError
from stagerd.sinks.fetch import RemoteStore
from stagerd.sinks.fsspec import FsspecSink
from stagerd.sinks.places import place_of
from tests.cli_helpers import run_cli


def _export(tmp_path):
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text("{}")
    return export


@pytest.mark.parametrize("where", ["the file", "under the file", "a link to the file"])
def test_a_sink_that_is_a_file_or_under_one_is_refused_wherever_it_is_opened(tmp_path, where):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the sink's directory belongs")
    path = {
        "the file": blocker,
        "under the file": blocker / "run" / "1",
        "a link to the file": tmp_path / "l",
    }
    if where == "a link to the file":
        path[where].symlink_to(blocker)
    url = path[where].as_uri()
    before = sorted(os.listdir(tmp_path))
    for open_it in (
        FsspecSink.from_url,
        RemoteStore.open,
        place_of,
        lambda u: place_of(u.removeprefix("file://")),
    ):
        with pytest.raises(ConfigError) as e:
            open_it(url)
        assert e.value.path == str(blocker), e.value
        assert "\n" not in str(e.value) and url.removeprefix("file://") in str(e.value), e.value
        assert "where a directory belongs" in str(e.value) and "nothing was written" in e.value.hint
    assert sorted(os.listdir(tmp_path)) == before


def test_a_sink_reached_through_a_link_that_leads_nowhere_is_down_until_its_target_is_there(tmp_path):
    export = _export(tmp_path)
    sink_dir, mount = tmp_path / "sink", tmp_path / "mnt"
    sink_dir.symlink_to(mount / "run")  # the filesystem it leads to is not mounted
    sink = FsspecSink.from_url(sink_dir.as_uri())  # no bad input: the sink is down
    with pytest.raises(SinkError) as e:
        sink.publish(export, 1)
    assert e.value.retryable and f"the link {sink_dir} -> {mount / 'run'} leads nowhere" in str(e.value), (
        e.value
    )
    assert e.value.path.startswith(sink_dir.as_uri()), e.value  # the sink's key: whose failure it is
    assert not mount.exists()  # nothing made where the link leads
    with pytest.raises(SinkError):  # down, not empty: nothing is taken for absent there
        sink.is_published(1)

    (mount / "run").mkdir(parents=True)  # mounted again
    sink.publish(export, 1)
    assert (mount / "run" / layout.step_dir_name(1) / layout.MANIFEST_NAME).is_file()


def test_a_file_put_where_an_open_sinks_directory_was_is_an_outage_retried(tmp_path):
    """Once the sink is open (a running daemon), a file in its place is retried as a sink that is down."""
    export = _export(tmp_path)
    sink_dir = tmp_path / "sink"
    sink = FsspecSink.from_url(sink_dir.as_uri())
    sink_dir.write_text("put here after the daemon started")
    with pytest.raises(SinkError) as e:
        sink.publish(export, 1)
    assert e.value.retryable and not isinstance(e.value, ConfigError), e.value
    sink_dir.unlink()
    sink.publish(export, 1)
    assert (sink_dir / layout.step_dir_name(1) / layout.MANIFEST_NAME).is_file()


@pytest.mark.parametrize("command", ["watch", "publish", "prune", "restore"])
def test_each_command_refuses_a_sink_under_a_file_with_exit_2_and_writes_nothing(tmp_path, command):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the sink's directory belongs")
    url, root = (blocker / "run").as_uri(), tmp_path / "root"
    root.mkdir()
    argv = {
        "watch": ["watch", root, "--sink", url, "--once"],
        "publish": ["publish", "--sink", url, "--step", "1", _export(tmp_path)],
        "prune": ["prune", url, "--keep-last", "1"],
        "restore": ["restore", url, root / "restored", "--step", "1"],
    }[command]
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    run = run_cli(argv)
    assert run.returncode == 2, run.stdout + run.stderr
    (said,) = [line for line in run.stderr.splitlines() if line.startswith("stagerd: ")]
    assert said.startswith(f"stagerd: ConfigError: {blocker}: sink URL "), run.stderr
    assert "lies under this file" in said and "Traceback" not in run.stderr, run.stderr
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_a_store_opened_again_that_became_a_file_is_an_outage(tmp_path):
    """The fleet opens its exchange again for each step: a file in its place since the start is the store
    changed under the daemon, retried as for a sink opened once, never a step quarantined for it."""
    from stagerd.sinks.fs_open import opening_again

    (tmp_path / "exchange").write_text("was a directory when the daemon started")
    url = (tmp_path / "exchange").as_uri()
    with pytest.raises(SinkError) as e, opening_again(url):
        FsspecSink.from_url(url)
    assert e.value.retryable and "exchange" in (e.value.path or "")
