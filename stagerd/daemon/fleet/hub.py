"""A fleet step's Hub lane (issue 14): the leader publishes the committed export as one commit and tag.

With only a Hub sink, the fleet builds the export on the exchange (`EXCHANGE/export/step-N/`, manifest
last) exactly as it would on an fsspec sink. Node 0's Hub lane then downloads it, checked against its
manifest, and hands it to `HubSink.publish`: one commit and one tag per step, as for one daemon. It then
creates `fleet/step-N/hub.json` on the exchange; the other nodes' Hub lanes wait for that record, so no
node's staged step is retired before the Hub holds the step. They wait as every fleet wait does
(`StepExchange.wait`): until `fleet_wait_seconds` pass with node 0's work not advancing, which node 0
reports (`Progress`) while it downloads the export and while the Hub takes it; then `FleetWaitError`.
**Limit**: the leader downloads the whole export for the Hub (the Hub takes a commit from one client), so
this lane is not split over the nodes.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from stagerd.contract import layout
from stagerd.daemon.fleet.exchange import Progress, StepExchange
from stagerd.errors import SinkError
from stagerd.sinks.base import PublishResult, Sink
from stagerd.sinks.fetch import RemoteStore, check_listing, download, read_manifest, step_prefix
from stagerd.sinks.fsspec import FsspecSink
from stagerd.sinks.prune import FLEET_DONE

EXPORT_PREFIX = "export"


def hub_record_key(step: int) -> str:
    return f"fleet/{layout.step_dir_name(step)}/hub.json"


def publish_to_hub(
    step: int,
    step_dir: Path,
    work: Path,
    hub: Sink,
    staging: FsspecSink,
    exchange: FsspecSink,
    store_url: str,
    *,
    exchange_store: RemoteStore,
    wait_seconds: float,
    poll_seconds: float = 0.5,
    status: Callable[[str, int], None] | None = None,
) -> PublishResult:
    """Node 0: the committed export from `staging` to `hub`, then the record; the others: the record,
    awaited on the exchange (read through `exchange_store`) as every fleet wait is."""
    t0 = time.monotonic()
    marker = layout.read_marker(step_dir)
    me = marker.staging_node
    x = StepExchange(
        exchange, exchange_store, step, me, marker.staging_nodes, wait_seconds, poll_seconds, status or _quiet
    )
    if exchange.backend.read(hub_record_key(step)) is not None:
        if me == 0:  # a leader killed between the Hub record and `done.json`
            exchange.backend.create(f"{x.base}/{FLEET_DONE}", b"{}")
        return _skipped(hub.url, step, t0)
    if me != 0:
        # done too once this node's own claim, made before its export ended, is gone: remote retention took
        # the step's records, which it does only once the leader recorded it done, after the Hub record
        x.wait(
            lambda: (
                exchange.backend.read(hub_record_key(step)) is not None
                or exchange.backend.read(x.claim_key(me)) is None
            ),
            lambda: f"waiting for node 0 to publish step {step} to the Hub{x.progress_of([0])}",
        )
        return _skipped(hub.url, step, t0)
    if not staging.is_published(step):
        raise SinkError(f"step {step} is not committed on the exchange yet", path=staging.url)
    store = RemoteStore.open(store_url)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        prefix = step_prefix(step, raw=False)
        manifest = read_manifest(store, prefix, step)
        check_listing(store, prefix, manifest)
        files = tuple(f for f in manifest.files if f.path != layout.MANIFEST_NAME)
        with Progress(x) as progress:  # for the other nodes' Hub lanes, waiting for the record
            fetched = progress.doing("downloading the export for the Hub")
            download(store, prefix, files, work, progress=fetched)
            sent = progress.doing("publishing it to the Hub")
            result = hub.publish(work, step, metadata=dict(marker.metadata), progress=sent)
    finally:
        store.close()
        shutil.rmtree(work, ignore_errors=True)
    exchange.backend.create(hub_record_key(step), json.dumps({"location": result.location}).encode())
    exchange.backend.create(f"{x.base}/{FLEET_DONE}", b"{}")  # retention may go on
    return result


def _quiet(text: str, missing: int) -> None:
    pass


def _skipped(url: str, step: int, t0: float) -> PublishResult:
    return PublishResult(url, step, url, 0, 0, 0, True, time.monotonic() - t0)
