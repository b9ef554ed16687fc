"""The fleet's Hub lane reads the exchange's Hub records as every lane reads a record: at most 1 MiB.
Anyone may put an object of any size at a record's key; before, each waiting node read it whole into
memory every poll, and took it for node 0's record."""

from __future__ import annotations

import pytest

from stagerd.daemon.fleet.exchange import MAX_RECORD_BYTES
from stagerd.daemon.fleet.hub import hub_record_key, publish_to_hub
from stagerd.errors import SinkConflictError
from stagerd.sinks.fetch import RemoteStore
from stagerd.sinks.fsspec import FsspecSink
from tests.daemon.fleet.test_protocol import STEP, _stage


@pytest.mark.parametrize("older", [False, True])
def test_a_hub_record_larger_than_any_record_is_refused_not_read_whole(tmp_path, dcp_mixed2, older):
    _, node_dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    ex = tmp_path / "exchange"
    exchange, staging = (FsspecSink.from_url(u) for u in (ex.as_uri(), (ex / "export").as_uri()))
    hub = FsspecSink.from_url((tmp_path / "hub").as_uri())  # never called: the record is refused first
    key = hub_record_key(STEP) if older else hub_record_key(STEP, hub.url)
    exchange.backend.create(key, b'{"location": "' + b"x" * MAX_RECORD_BYTES + b'"}')
    with pytest.raises(SinkConflictError, match=f"over {MAX_RECORD_BYTES} bytes") as info:
        publish_to_hub(
            STEP,
            node_dirs[1],
            tmp_path / "w",
            hub,
            staging,
            exchange,
            staging.url,
            exchange_store=RemoteStore.open(ex.as_uri()),
            wait_seconds=0.3,
            poll_seconds=0.05,
        )
    assert key in str(info.value) and not info.value.retryable
