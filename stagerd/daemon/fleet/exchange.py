"""One fleet step on the exchange, as one node sees it: the keys of its claims and file records, their
conditional creates and reads, the byte ranges of other nodes' parts, the files sent to a sink's
`step-N/`, and the waits for other nodes (`wait`), which show what the nodes they await report of their
work (`progress_of`; the reports themselves are `progress.py`'s)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any, TypeVar

from stagerd.contract import layout
from stagerd.contract.json_fields import loads
from stagerd.contract.manifest import MAX_MANIFEST_BYTES
from stagerd.daemon.fleet.progress import Progress, Reports, progress_key
from stagerd.daemon.fleet.records import sink_id
from stagerd.errors import (
    FleetWaitError,
    SinkAuthError,
    SinkConflictError,
    SinkError,
    StagerdError,
    StepClaimedError,
)
from stagerd.sinks.claims import Claim, claim_key, claimed_error, decode, fleet_owned
from stagerd.sinks.denied import denied_hint
from stagerd.sinks.fetch import RemoteStore
from stagerd.sinks.fsspec import FsspecSink
from stagerd.sinks.objects import MAX_CLAIM_BYTES, ByteProgress, LocalFile, Uploaded

FLEET_DIR = "fleet"
RECORDS_DIR = "done"  # one record per sink and built file
FAILED_DIR = "failed"  # one record per sink and node: that node's last try of that sink, failed or not
MAX_RECORD_BYTES = 1 << 20  # a claim, record or failure is under 1 KiB (a claim names each sink in 16 bytes)
T = TypeVar("T")


class Stopped(Exception):
    """The daemon is stopping: a wait for other nodes ends at once rather than holding the shutdown for
    its whole grace period (it holds nothing the step needs: the step is abandoned as the drain abandons
    work, and the next start waits again)."""


class StepExchange:
    """Node `me` of `nodes`' view of step `step` on `exchange` (read through `store`)."""

    def __init__(
        self,
        exchange: FsspecSink,
        store: RemoteStore,
        step: int,
        me: int,
        nodes: int,
        wait_seconds: float,
        poll_seconds: float,
        status: Callable[[str, int], None],
        stopping: Callable[[], bool] | None = None,
        save: str = "",
    ) -> None:
        """`save`: the save's digest alike on every node (`records.save_id`), which `broken.record` names."""
        self.exchange, self.store, self.save = exchange, store, save
        self.stopping = stopping or (lambda: False)
        self.step, self.me, self.nodes = step, me, nodes
        self.wait_seconds, self.poll_seconds, self.status = wait_seconds, poll_seconds, status
        self.base = f"{FLEET_DIR}/{layout.step_dir_name(step)}"
        self.waited = 0.0  # seconds asleep in `wait`
        self.reports = Reports(store, self.base)  # the other nodes' reports of their work
        self._elsewhere: dict[tuple[int, ...], tuple[str, float]] = {}  # `claimed_elsewhere`: text, read at
        self._past: dict[str, bytes] = {}  # failure key -> the record a past try left there (`past_failures`)

    def claim_key(self, node: int) -> str:
        return f"{self.base}/node-{node:05d}.json"

    def record_key(self, sink: FsspecSink, name: str) -> str:
        """One record per sink and file: the store checksum it holds is that sink's."""
        return f"{self.base}/{RECORDS_DIR}/{sink_id(sink.url)}/{name}.json"

    def record_data(self, sink: FsspecSink, name: str) -> dict[str, Any] | None:
        return self.read_json(self.record_key(sink, name))

    def failure_key(self, sink: FsspecSink, node: int) -> str:
        return f"{self.base}/{FAILED_DIR}/{sink_id(sink.url)}/node-{node:05d}.json"

    def record_failure(self, sink: FsspecSink, err: StagerdError | None) -> None:
        """This node's try of `sink` failed with `err` (None: a new try begins, which clears a failure), so
        that the nodes waiting on it for that sink stop waiting and leave the sink to its own lane."""
        key = self.failure_key(sink, self.me)
        if err is None and not (self.read_json(key) or {}).get("error"):
            return  # nothing to clear: no write on the way of a healthy sink
        msg = None if err is None else str(err).splitlines()[0][:500]
        error = None if err is None else err.name
        # `try`: a failure of this try never reads as the same bytes as a past try's (`past_failures`)
        data = json.dumps({"node": self.me, "error": error, "message": msg, "try": uuid.uuid4().hex})
        _named(self.exchange.url, key, lambda: self.exchange.backend.write(key, data.encode()))

    def claimed_elsewhere(self, sink: FsspecSink, nodes: Iterable[int]) -> str:
        """For a wait's text: where `sink`, not the exchange, holds this step's claim of one of `nodes`,
        that node's daemon meets the others there (it runs with another `--exchange`, or none) and waits
        for them as they wait for it. Read again at most as often as a node reports its progress; once
        found, kept (the text stays the same, as the wait needs)."""
        nodes = tuple(nodes)
        if sink.url.rstrip("/") == self.exchange.url.rstrip("/"):
            return ""
        said, at = self._elsewhere.get(nodes, ("", -1e9))
        if not said and time.monotonic() - at >= max(self.poll_seconds, min(self.wait_seconds / 4, 10.0)):
            b, keys = sink.backend, {k: self.claim_key(k) for k in nodes}
            there = [
                k
                for k, key in keys.items()
                if _named(sink.url, key, partial(b.read, key, MAX_RECORD_BYTES + 1))
            ]
            if there:
                said = (
                    f"; node {there[0]} claimed this step on {sink.url}, not on this node's exchange "
                    f"{self.exchange.url}: every node's daemon must pass the same --exchange"
                )
            self._elsewhere[nodes] = (said, time.monotonic())
        return said

    def failure_of(self, sink: FsspecSink, nodes: Iterable[int]) -> SinkError | None:
        """Where one of `nodes` (other than this one) failed its last try of `sink`: the `SinkError` that
        stops this node's work for that sink too (retryable: the sink's lane tries again); else None."""
        listed = self.store.sizes(f"{self.base}/{FAILED_DIR}/{sink_id(sink.url)}")
        for k in sorted(set(nodes) - {self.me}):
            if f"node-{k:05d}.json" not in listed:
                continue
            key = self.failure_key(sink, k)
            data = self._read(key)
            if data is None or data == self._past.get(key):
                continue  # a past try's, which that node's new try clears
            d = self._parse(key, data)
            if d.get("error"):
                # another publisher's complete step is no passing fault: every node stops on it, unretried
                kind = SinkConflictError if d["error"] == SinkConflictError.__name__ else SinkError
                return kind(
                    f"step {self.step}: node {k} could not publish its part to this sink "
                    f"({d['error']}: {d.get('message')})",
                    path=sink.url,
                    hint=f"node {k}'s daemon log and `stagerd status` name the cause; its lane for this sink "
                    "retries by itself, and so does this one",
                )
        return None

    def failure(self, err: SinkError, sinks: Iterable[FsspecSink] = ()) -> SinkError:
        """`err` said as the exchange's failure where it is one (a key of its `fleet/` or `raw/`, not a sink's
        `step-N/`): every node meets there, so no sink of the step goes on without it, and no node moves to
        another place the others would not agree on. The hint names `--exchange`, which keeps a dead sink
        from being the exchange too."""
        path, step = err.path or "", layout.step_dir_name(self.step)
        if type(err) not in (SinkError, SinkAuthError) or not path.startswith(
            self.exchange.url.rstrip("/") + "/"
        ):
            return err
        # a sink's upload (the exchange may be a sink too, or hold one) is that sink's lane's
        if any(
            path.startswith(f"{u.rstrip('/')}/{step}") for u in [s.url for s in sinks] + [self.exchange.url]
        ):
            return err
        auth = isinstance(err, SinkAuthError)
        what = "check its credentials and write permission" if auth else "stagerd retries with backoff"
        return (SinkAuthError if auth else SinkError)(
            f"step {self.step}: the fleet's exchange failed, no sink of the step goes on without it: "
            f"{err.message}",
            path=path,
            hint=f"{what}; every node meets on the exchange, the first fsspec sink unless --exchange names "
            "another: to keep the other sinks publishing when one sink dies, give every node's daemon the "
            "same --exchange URL, a store or prefix no sink uses",
        )

    def read_json(self, key: str) -> dict[str, Any] | None:
        """A claim or record on the exchange; None: there is none. One that is not a JSON object (written by
        another tool, or damaged) is a named error naming it, never taken for a claim or a record."""
        data = self._read(key)
        return None if data is None else self._parse(key, data)

    def past_failures(self, sinks: Iterable[FsspecSink]) -> None:
        """The other nodes' failure records of `sinks` as this try begins: left by past tries, whose nodes
        clear them as their own new tries begin, perhaps after this one reads them. Until a node writes
        its record again, `failure_of` takes it for no failure: a healed sink's lane is not stopped by the
        failure that sent it there, and a node that is gone shows as one to wait for."""
        for sink in sinks:
            prefix = f"{self.base}/{FAILED_DIR}/{sink_id(sink.url)}"
            for name in self.store.sizes(prefix):
                key = f"{prefix}/{name}"
                if key != self.failure_key(sink, self.me) and (data := self._read(key)) is not None:
                    self._past[key] = data

    def _read(self, key: str) -> bytes | None:
        """At most `MAX_RECORD_BYTES` and one more: anyone may put an object of any size at a record's key,
        and a node read it whole into memory, every poll."""
        b = self.exchange.backend
        data: bytes | None = _named(self.exchange.url, key, lambda: b.read(key, MAX_RECORD_BYTES + 1))
        return data

    def _parse(self, key: str, data: bytes) -> dict[str, Any]:
        try:
            d = loads(data) if len(data) <= MAX_RECORD_BYTES else None
        except ValueError:
            d = None
        if not isinstance(d, dict):
            big = f" (over {MAX_RECORD_BYTES} bytes)" if len(data) > MAX_RECORD_BYTES else ""
            raise SinkConflictError(
                f"step {self.step}: {key} on the exchange is not JSON of a fleet claim or record{big}",
                path=f"{self.exchange.url}/{key}",
                hint="stagerd did not write it; remove it from the exchange (the node it names writes its "
                f"own again), then run `stagerd retry ROOT --step {self.step}` on every node",
            )
        return d

    def progress_of(self, nodes: Iterable[int]) -> str:
        """What `nodes` last reported of their work, for a wait's text (`Reports.of`)."""
        return self.reports.of(nodes)

    def reporting(self) -> Progress:
        """This node's reports of its work for the others' waits, at most every quarter of the wait."""
        every = max(self.poll_seconds, min(self.wait_seconds / 4, 10.0))
        return Progress(self.exchange, progress_key(self.base, self.me), self.step, every)

    def create(self, key: str, data: bytes) -> bool:
        return _named(self.exchange.url, key, lambda: self.exchange.backend.create(key, data))

    def write(self, key: str, data: bytes) -> None:
        _named(self.exchange.url, key, lambda: self.exchange.backend.write(key, data))

    def read(self, key: str, start: int, end: int) -> bytes:
        data: bytes = _named(
            self.exchange.url, key, lambda: self.store.fs.cat_file(self.store.path(key), start=start, end=end)
        )
        return data

    def upload(
        self, sink: FsspecSink, files: list[LocalFile], progress: Callable[[int, int], None] | None = None
    ) -> list[Uploaded]:
        prefix = layout.step_dir_name(self.step)
        sent = ByteProgress(sum(f.size for f in files), progress)
        out: list[Uploaded] = _named(sink.url, prefix, lambda: sink.backend.upload(prefix, files, sent))
        return out

    def claim_step(self, sink: FsspecSink, mine: Claim) -> bytes:
        """The leader's claim of the export on `sink` (`claims.fleet_claim`), made before any node writes
        under its `step-N/` (`fleet/stake.py`) and again before its manifest. Kept where an earlier try of
        this leader made it. Another publisher's claim of a step without a manifest is `StepClaimedError`
        (retried); with one, the step is that publisher's and `SinkConflictError`: nothing of the fleet
        goes there. Returns the claim the sink holds."""
        key, b = self._step_claim_key(), sink.backend
        if _named(sink.url, key, lambda: b.create(key, mine.encode())):
            return mine.encode()
        held = self._step_claim(sink)
        if fleet_owned(held, mine):
            return held or b""
        if self.committed(sink):
            raise self._theirs(sink, held)
        raise claimed_error(f"{sink.url}/{key}", held, self.step)

    def committed_here(self, sink: FsspecSink, mine: Claim) -> bytes | None:
        """Where `sink` holds the step complete (its manifest): the claim there, the fleet's own (an
        earlier try committed it) or none (a commit from before claims); nothing is to be written there
        again. Another publisher's is `SinkConflictError`. None where the step has no manifest."""
        if not self.committed(sink):
            return None
        held = self._step_claim(sink)
        if held is None or fleet_owned(held, mine):
            return held or b""
        raise self._theirs(sink, held)

    def committed(self, sink: FsspecSink) -> bool:
        """`sink` holds the step's manifest."""
        manifest, b = f"{layout.step_dir_name(self.step)}/{layout.MANIFEST_NAME}", sink.backend
        # capped: anyone may put an object of any size at that key
        return _named(sink.url, manifest, lambda: b.read(manifest, MAX_MANIFEST_BYTES + 1)) is not None

    def _step_claim_key(self) -> str:
        return claim_key(layout.step_dir_name(self.step))

    def _step_claim(self, sink: FsspecSink) -> bytes | None:
        """The step's claim on `sink`, read capped: anyone may put an object of any size at its key."""
        key, b = self._step_claim_key(), sink.backend
        data: bytes | None = _named(sink.url, key, lambda: b.read(key, MAX_CLAIM_BYTES + 1))
        return data

    def _theirs(self, sink: FsspecSink, held: bytes | None) -> SinkConflictError:
        who = decode(held)
        return SinkConflictError(
            f"step {self.step} is {who.describe() if who else 'another publisher'}'s complete step on this "
            "sink; nothing of the fleet's export was written there",
            path=f"{sink.url}/{layout.step_dir_name(self.step)}",
            hint="two runs publish to one prefix: give each its own prefix; to publish the fleet's export "
            "there instead, delete that step (`stagerd prune`), then `stagerd retry ROOT --step N`",
        )

    def claim_error(self, sink: FsspecSink, held: bytes | None) -> StepClaimedError | None:
        """Before this node writes under `sink`'s `step-N/`: None where the sink holds the claim the leader
        recorded (`held`). Else the `StepClaimedError` of a publish that finds another's claim: nothing of
        this publish was written there."""
        key, now = self._step_claim_key(), self._step_claim(sink)
        if now == held:
            return None
        if now is None:  # taken since the leader claimed it (by hand, or a prune): its next try claims again
            return StepClaimedError(
                f"step {self.step}: the claim the fleet's leader made is gone from this sink; nothing of "
                "this publish was written there",
                path=f"{sink.url}/{key}",
                hint="the leader claims the step again on the retry, which stagerd makes by itself",
            )
        return claimed_error(f"{sink.url}/{key}", now, self.step)

    def wait(self, done: Callable[[], bool], what: Callable[[], str]) -> None:
        """Poll `done` until it holds; `what` says what is awaited ("waiting for node 1, 2 (seen: ...)"),
        reported as soon as it is found missing and cleared (`status("", 0)`) once the wait is over. It
        fails once `wait_seconds` pass with `what` unchanged: a new part, record or claim is progress, and
        so is an awaited node's work that advanced (`progress_of`), never the same work done again."""
        if done():
            return
        # each wait its own: the raw upload and the builds before it may take longer than the setting;
        # and each change its own: 8 owners' records arriving a minute apart are no node that never comes
        last, deadline = None, 0.0
        while not done():
            text = what()
            if text != last:
                last, deadline = text, time.monotonic() + self.wait_seconds
            named = text.split(" (", 1)[0].rsplit("node ", 1)[-1]
            self.status(text, len([n for n in named.split(", ") if n.isdigit()]) or 1)
            if self.stopping():
                raise Stopped(f"step {self.step}, node {self.me}: {text}")
            if time.monotonic() >= deadline:
                raise FleetWaitError(
                    f"step {self.step}, node {self.me}: {text}: nothing new for {self.wait_seconds:g} s",
                    path=self.exchange.url,
                )
            time.sleep(self.poll_seconds)
            self.waited += self.poll_seconds
        self.status("", 0)


def _named(url: str, key: str, fn: Callable[[], T]) -> T:
    """One store operation of the fleet (which calls the backends directly, not through a sink's publish):
    an OS-level failure is the named sink error a single daemon's publish gives it, naming the key."""
    try:
        return fn()
    except StagerdError:
        raise
    except PermissionError as e:
        raise SinkAuthError(
            f"permission denied: {e.strerror or e}", path=f"{url}/{key}", hint=denied_hint(url)
        ) from None
    except OSError as e:
        raise SinkError(f"{type(e).__name__}: {e.strerror or e}", path=f"{url}/{key}") from None
