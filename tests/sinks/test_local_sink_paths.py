"""A `file://` sink reached through a link whose target is gone (its filesystem not mounted) is what a sink
going down looks like: retried, read as down rather than empty, and published once the target is there."""

from __future__ import annotations

import pytest

from stagerd.contract import layout
from stagerd.errors import SinkError
from stagerd.sinks.fsspec import FsspecSink


def _export(tmp_path):
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text("{}")
    return export


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
