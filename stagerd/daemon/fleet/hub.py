"""A fleet step's Hub lane (issue 14): the leader publishes the committed export as one commit and tag.

With only a Hub sink, the fleet builds the export on the exchange (`EXCHANGE/export/step-N/`, manifest
last) exactly as it would on an fsspec sink. Node 0's Hub lane then downloads it, checked against its
manifest, and hands it to `HubSink.publish`: one commit and one tag per step, as for one daemon. It then
creates that Hub sink's record, `fleet/step-N/hub/SINK.json`, on the exchange; the other nodes' lanes for
that sink wait for it, so no node's staged step is retired before every Hub sink holds the step. Each Hub
sink has its own record and its own download: with two, one sink's record never stands for the other's.
`done.json` (retention may take the step's records) follows only once every Hub sink's record is there.
A fleet with one Hub sink also writes, and accepts, the record an older stagerd knows (`hub.json`).
The other nodes wait as every fleet wait does (`StepExchange.wait`): until `fleet_wait_seconds` pass with
node 0's work not advancing, which node 0 reports (`Progress`) while it downloads the export and while the
Hub takes it; then `FleetWaitError`.
**Limit**: the leader downloads the whole export for the Hub (the Hub takes a commit from one client), so
this lane is not split over the nodes.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from stagerd.contract import commit_marker, layout
from stagerd.contract.json_fields import loads
from stagerd.daemon.fleet.exchange import MAX_RECORD_BYTES, StepExchange
from stagerd.daemon.fleet.records import sink_id
from stagerd.errors import SinkConflictError, SinkError
from stagerd.sinks.base import PublishResult, Sink
from stagerd.sinks.fetch import RemoteStore, check_listing, download, read_manifest, step_prefix
from stagerd.sinks.fs_open import opening_again
from stagerd.sinks.fsspec import FsspecSink
from stagerd.sinks.prune import FLEET_DONE


def hub_record_key(step: int, url: str | None = None) -> str:
    """Hub sink `url`'s record that it holds `step`; None: the one record of an older stagerd, which knew a
    single Hub sink."""
    base = f"fleet/{layout.step_dir_name(step)}"
    return f"{base}/hub.json" if url is None else f"{base}/hub/{sink_id(url)}.json"


def _recorded(exchange: FsspecSink, step: int, url: str, hubs: Sequence[str]) -> bool:
    """Hub sink `url` holds `step`: its record, or (the fleet's one Hub sink) the record an older stagerd
    knows, unless that names another sink (the fleet's Hub sink since changed)."""
    if _read(exchange, step, hub_record_key(step, url)) is not None:
        return True
    old = _read(exchange, step, hub_record_key(step)) if len(hubs) == 1 else None
    if old is None:
        return False
    try:
        named = loads(old).get("sink") or url  # an older stagerd's names none
    except (ValueError, AttributeError):
        named = url
    return bool(sink_id(str(named)) == sink_id(url))


def _read(exchange: FsspecSink, step: int, key: str) -> bytes | None:
    """A Hub record, at most `MAX_RECORD_BYTES` (as every lane reads the exchange): anyone may put an object
    of any size at its key, and each waiting node read it whole into memory, every poll."""
    data = exchange.backend.read(key, MAX_RECORD_BYTES + 1)
    if data is not None and len(data) > MAX_RECORD_BYTES:
        raise SinkConflictError(
            f"step {step}: {key} on the exchange is not a Hub record (over {MAX_RECORD_BYTES} bytes)",
            path=f"{exchange.url}/{key}",
            hint="stagerd did not write it; remove it from the exchange (node 0 writes its own again), then "
            f"run `stagerd retry ROOT --step {step}` on every node",
        )
    return data


def all_hubs_recorded(exchange: FsspecSink, step: int, hubs: Sequence[str]) -> bool:
    """Every Hub sink of the fleet (`hubs`, none: not known) holds `step`."""
    return bool(hubs) and all(_recorded(exchange, step, u, hubs) for u in hubs)


def _done_if_all(
    x: StepExchange, exchange: FsspecSink, step: int, hubs: Sequence[str], sinks: Sequence[FsspecSink]
) -> None:
    """Node 0: `done.json` (retention may take the step's records, node 1..N's claims among them, which
    their lanes take for done) once every Hub sink's record is there and every fsspec sink (`sinks`) holds
    the step (a failed one's lane still builds from the raw parts); the last lane to get there writes it."""
    if all_hubs_recorded(exchange, step, hubs) and all(_holds(s, step) for s in sinks):
        exchange.backend.create(f"{x.base}/{FLEET_DONE}", b"{}")


def _holds(sink: FsspecSink, step: int) -> bool:
    try:
        return sink.is_published(step)
    except SinkError:
        return False  # unreachable: its own lane says so, and this one's publish stands


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
    hubs: Sequence[str] = (),
    sinks: Sequence[FsspecSink] = (),
    stopping: Callable[[], bool] | None = None,
    pause: Callable[[], None] | None = None,
) -> PublishResult:
    """Node 0: the committed export from `staging` to `hub`, then its record; the others: that record,
    awaited on the exchange (read through `exchange_store`) as every fleet wait is. `hubs`: the URL of
    every Hub sink of the fleet (`hub`'s alone when empty); `sinks`: its fsspec sinks, each of which must
    hold the step before `done.json` (none: a Hub record follows `staging`'s commit, which is the only
    one); `work` must be this sink's own. `pause`: after each piece downloaded into `work` (this node's
    disk), never in the upload to the Hub (the network's)."""
    t0 = time.monotonic()
    hubs = tuple(hubs) or (hub.url,)
    marker = commit_marker.read_marker(step_dir)
    me = marker.staging_node
    x = StepExchange(
        exchange,
        exchange_store,
        step,
        me,
        marker.staging_nodes,
        wait_seconds,
        poll_seconds,
        status or _quiet,
        stopping,
    )
    if _recorded(exchange, step, hub.url, hubs):
        if me == 0:  # a leader killed between the Hub record and `done.json`
            _done_if_all(x, exchange, step, hubs, sinks)
        return _skipped(hub.url, step, t0)
    if me != 0:
        # done too once this node's own claim, made before its export ended, is gone: remote retention took
        # the step's records, which it does only once the leader recorded it done, after every Hub record
        x.wait(
            lambda: (
                _recorded(exchange, step, hub.url, hubs)
                or exchange.backend.read(x.claim_key(me), MAX_RECORD_BYTES + 1) is None
            ),
            lambda: (
                f"waiting for node 0 to publish step {step} to the Hub sink {hub.url}{x.progress_of([0])}"
            ),
        )
        return _skipped(hub.url, step, t0)
    if not staging.is_published(step):
        raise SinkError(f"step {step} is not committed on the exchange yet", path=staging.url)
    with opening_again(store_url):
        store = RemoteStore.open(store_url)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        prefix = step_prefix(step, raw=False)
        manifest = read_manifest(store, prefix, step)
        check_listing(store, prefix, manifest)
        files = tuple(f for f in manifest.files if f.path != layout.MANIFEST_NAME)
        with x.reporting() as progress:  # for the other nodes' Hub lanes, waiting for the record
            # each named by its sink: a report counts only when its work advanced, and the bytes of a second
            # Hub sink are the first's again, yet new work
            fetched = progress.doing(f"downloading the export for {hub.url}")
            download(store, prefix, files, work, progress=_then(fetched, pause))
            sent = progress.doing(f"publishing it to {hub.url}")
            result = hub.publish(work, step, metadata=dict(marker.metadata), progress=sent)
    finally:
        store.close()
        shutil.rmtree(work, ignore_errors=True)
    record = json.dumps({"location": result.location, "sink": hub.url}).encode()
    exchange.backend.create(hub_record_key(step, hub.url), record)
    if len(hubs) == 1:  # what an older node's lane waits for
        exchange.backend.create(hub_record_key(step), record)
    _done_if_all(x, exchange, step, hubs, sinks)  # retention may go on
    return result


def _then(report: Callable[[int, int], None], pause: Callable[[], None] | None) -> Callable[[int, int], None]:
    if pause is None:
        return report

    def both(done: int, total: int) -> None:
        report(done, total)
        pause()

    return both


def _quiet(text: str, missing: int) -> None:
    pass


def _skipped(url: str, step: int, t0: float) -> PublishResult:
    return PublishResult(url, step, url, 0, 0, 0, True, time.monotonic() - t0)
