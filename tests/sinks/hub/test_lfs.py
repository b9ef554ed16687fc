"""The LFS upload path (`HF_HUB_DISABLE_XET=1`, or hf_xet not installed), against the Hub test server.

`create_commit` uploads LFS objects itself here: basic PUTs, or multipart for the big shard. The sink still
leaves out files the parent commit holds, and counts the bytes of the files it commits as sent.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from huggingface_hub import hf_hub_download, snapshot_download

from stagerd.errors import SinkError
from stagerd.sinks.hub import step_tag
from tests.hubserver import Fault
from tests.sinks.hub.hub_helpers import REPO, export_files, make_sink, write_export


@pytest.fixture
def xet():
    return False


def test_lfs_publish_multipart_and_basic_then_a_step_sends_only_what_changed(hub, tmp_path):
    export = write_export(tmp_path / "export")
    first = make_sink(hub).publish(export, 1)

    assert hub.stats.count("PUT", r"^/_lfs/part/") == 3  # the big shard went multipart
    assert hub.stats.count("PUT", r"^/_lfs/put/") == 1  # the small one in one PUT
    assert not hub.stats.xorb_uploads and not hub.stats.xet_tokens  # no Xet at all
    assert first.bytes_uploaded == first.bytes_total
    (export / "config.json").write_text('{"model_type": "llama", "seed": 1}')
    second = make_sink(hub).publish(export, 2)

    assert hub.stats.count("PUT", r"^/_lfs/") == 4  # no shard sent again
    assert second.bytes_uploaded < 2000  # config.json and the card, inline in the commit
    local = Path(
        snapshot_download(
            REPO, revision=step_tag(2), endpoint=hub.endpoint, token=hub.token, local_dir=tmp_path / "dl"
        )
    )
    for rel, data in export_files(export).items():
        assert (local / rel).read_bytes() == data, rel


def test_failed_upload_resumes_without_resending_finished_objects(hub, tmp_path):
    export = write_export(tmp_path / "export")
    # the parts fail only once the small shard is stored: huggingface_hub cancels uploads not yet started
    # when one fails, so without the wait a loaded machine could fail the parts before the small one began
    small_done = lambda: len(hub.stats.lfs_uploads) >= 1  # noqa: E731
    hub.faults.add(Fault("PUT", r"^/_lfs/part/", status=400, times=100, not_before=small_done))
    with pytest.raises(SinkError):
        make_sink(hub).publish(export, 9)
    assert hub.stats.commits[REPO] == 0
    done = dict(hub.stats.lfs_uploads)
    assert len(done) == 1  # the small shard made it, the multipart one did not
    hub.faults.clear()

    make_sink(hub).publish(export, 9)

    assert hub.stats.commits[REPO] == 1
    assert len(hub.stats.lfs_uploads) == 2 and all(n == 1 for n in hub.stats.lfs_uploads.values())


def test_connection_dropped_mid_upload_is_retried(hub, tmp_path):
    export = write_export(tmp_path / "export")
    hub.faults.add(Fault("PUT", r"^/_lfs/part/", drop=True, drop_after=60_000, skip=1))

    make_sink(hub).publish(export, 12)

    assert hub.stats.count("PUT", r"^/_lfs/part/", status=0) == 1  # one part lost its connection
    assert hub.stats.commits[REPO] == 1
    assert all(n == 1 for n in hub.stats.lfs_uploads.values())
    path = hf_hub_download(
        REPO,
        "model-00001-of-00002.safetensors",
        revision="step-12",
        endpoint=hub.endpoint,
        token=hub.token,
        cache_dir=tmp_path / "cache",
    )
    assert Path(path).read_bytes() == (export / "model-00001-of-00002.safetensors").read_bytes()


def test_one_hung_lfs_upload_times_out_and_is_sent_again(hub, tmp_path):
    export = write_export(tmp_path / "export")
    hub.faults.add(Fault("PUT", r"^/_lfs/", hang=True))

    t0 = time.monotonic()
    result = make_sink(hub, timeout=0.5).publish(export, 6)
    elapsed = time.monotonic() - t0
    hub.faults.release()

    assert not result.skipped and hub.stats.commits[REPO] == 1
    assert elapsed < 20, elapsed
    assert all(n == 1 for n in hub.stats.lfs_uploads.values()) and len(hub.stats.lfs_uploads) == 2
    path = hf_hub_download(
        REPO,
        "model-00001-of-00002.safetensors",
        revision="step-6",
        endpoint=hub.endpoint,
        token=hub.token,
        cache_dir=tmp_path / "cache",
    )
    assert Path(path).read_bytes() == (export / "model-00001-of-00002.safetensors").read_bytes()
