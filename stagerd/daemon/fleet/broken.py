"""A node's part of a save stopped on what no retry mends (its own staged step torn, the leader's refusal of
a file): recorded on the exchange (`fleet/step-N/broken/node-K.json`), so the nodes waiting for it stop
and quarantine the step too, rather than waiting again for as long as they run."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterable, Iterator

from stagerd import errors
from stagerd.daemon.fleet.exchange import StepExchange
from stagerd.errors import (
    ExtrasError,
    HeaderError,
    MarkerError,
    ShardError,
    SinkError,
    StagerdError,
    StepConflictError,
    SymlinkError,
)

log = logging.getLogger("stagerd.fleet")

BROKEN_DIR = "broken"  # one record per node
# errors of this node's own staged step (a shard missing or torn): no other node can send its part
STEP_FAULTS = (ExtrasError, HeaderError, MarkerError, ShardError, SymlinkError)


def record(x: StepExchange, err: StagerdError | None) -> None:
    """This node's part of the save stopped with `err` (None: a new try begins, which clears it)."""
    key = f"{x.base}/{BROKEN_DIR}/node-{x.me:05d}.json"
    if err is None and not (x.read_json(key) or {}).get("error"):
        return  # nothing to clear: no write on the way of a healthy step
    msg = None if err is None else str(err).splitlines()[0][:500]
    data = {"node": x.me, "save": x.save, "error": None if err is None else err.name, "message": msg}
    x.write(key, json.dumps(data).encode())


def broken_of(x: StepExchange, nodes: Iterable[int]) -> StagerdError | None:
    """Where one of `nodes` recorded that its part of the save stopped (`record`): its error, of its class
    where stagerd names one that no retry mends, to quarantine the step here too."""
    prefix = f"{x.base}/{BROKEN_DIR}"
    listed = x.store.sizes(prefix)
    for k in sorted(set(nodes) - {x.me}):
        key = f"{prefix}/node-{k:05d}.json"
        if f"node-{k:05d}.json" not in listed or (d := x.read_json(key)) is None:
            continue
        if not d.get("error") or d.get("save") != x.save:  # cleared, or another save's
            continue
        kind = getattr(errors, str(d["error"]), None)
        if not (isinstance(kind, type) and issubclass(kind, StagerdError)) or kind.retryable:
            kind = StepConflictError
        return kind(
            f"step {x.step}: node {k} stopped, no retry mends it ({d['error']}: {d.get('message')})",
            path=f"{x.exchange.url}/{key}",
            hint=f"node {k}'s daemon log and `stagerd status` name the cause; mend it, run `stagerd "
            f"retry ROOT --step {x.step}` on node {k}, then on every other node",
        )
    return None


@contextlib.contextmanager
def stopping(x: StepExchange, *kinds: type[StagerdError]) -> Iterator[None]:
    """An error of `kinds` quarantines the step on this node; recorded, it stops the others too."""
    try:
        yield
    except kinds as e:
        try:
            record(x, e)
        except SinkError as w:  # the exchange's own failure: the others time out as before
            log.warning("step %d: could not record node %d's failure: %s", x.step, x.me, w)
        raise
