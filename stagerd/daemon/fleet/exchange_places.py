"""The exchange's own names at its top, and the check that no sink lies among them nor it among a sink's.

The fleet writes on the exchange `raw/step-N/node-K-of-M/` (each node's raw part), `fleet/step-N/` (claims,
file records, progress, the leader's done mark) and, with only Hub sinks, builds the export in
`export/` (a sink of its own there: `tasks.py`). The exchange may be a sink's very place: that is the
default (the first fsspec sink), laid out to share it (the sink's retention reads `fleet/step-N/`).
"""

from __future__ import annotations

from stagerd.sinks.fetch import RAW_DIR
from stagerd.sinks.own_places import Area, refuse_nested, sink_area
from stagerd.sinks.prune import FLEET_DIR

EXPORT_PREFIX = "export"
_OWN = frozenset({RAW_DIR, FLEET_DIR, EXPORT_PREFIX})


def exchange_area(url: str) -> Area:
    return Area(
        url,
        "exchange",
        _OWN.__contains__,
        "the fleet's raw parts and records on the exchange and the sink's steps would share names, and "
        "one side's deletes could reach the other's files",
        "give --exchange a prefix beside the sinks' (e.g. s3://BUCKET/exchange next to s3://BUCKET/run1), "
        "or the very URL of an fsspec sink, or leave it unset to use the first fsspec sink; nothing was "
        "written",
    )


def refuse_exchange_among_sinks(exchange: str, sinks: list[str]) -> None:
    """A ConfigError where the exchange lies inside a sink's own places or a sink inside the exchange's
    (resolved, as sinks are compared: `own_places.refuse_nested`)."""
    refuse_nested([exchange_area(exchange), *(sink_area(u) for u in sinks)])
