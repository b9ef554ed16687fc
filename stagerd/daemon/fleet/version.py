"""Which fleet protocol a node speaks: the format of what it writes on the exchange and what it expects the
others to write there. Each node's claim names it (`protocol`) and its stagerd's version (`stagerd`); a
claim by a stagerd from before both names neither: protocol 1.

Nodes of two builds may not finish a step together (a leader from before the sink claims never records
one, and a newer owner waits for that record until the fleet wait ends), and a build from before
protocol 2 cannot be told apart from one that differs so. So a node that sees another speak another
protocol says so at once (`FleetVersionError`, naming both), before anything is claimed or written on a
sink, and records it as each sink's failure on the exchange: a node of an older build, which knows no
protocol, stops on that record too (it reads the others' failures) instead of waiting for the setting."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from stagerd import __version__
from stagerd.daemon.fleet.exchange import StepExchange
from stagerd.errors import FleetVersionError
from stagerd.sinks.fsspec import FsspecSink

# Bump whenever what a node writes on the exchange, or what it expects the others to write there, changes
# so that nodes of the two builds could not finish a step together.
PROTOCOL = 2
BEFORE = 1  # a claim that names no protocol: a stagerd from before protocol versions


def build() -> dict[str, Any]:
    """What this node's claim names of its build."""
    return {"protocol": PROTOCOL, "stagerd": __version__}


def same_build(claim: dict[str, Any]) -> bool:
    """`claim` names this node's build (else this ROOT's daemon, restarted on another, writes it again)."""
    return all(claim.get(k) == v for k, v in build().items())


def protocol_of(claim: dict[str, Any]) -> object:
    return claim.get("protocol", BEFORE)


def describe(claim: dict[str, Any]) -> str:
    """A claim's build in words, "stagerd 0.2.0 (fleet protocol 2)", for an error's message."""
    if "protocol" not in claim:
        return f"a stagerd from before fleet protocol versions (protocol {BEFORE})"
    return f"stagerd {claim.get('stagerd', '?')} (fleet protocol {claim['protocol']!r})"


def same_protocol(x: StepExchange, sinks: Iterable[FsspecSink]) -> None:
    """Every other node's claim names this node's protocol; else `FleetVersionError`, naming the first node
    that differs, recorded first as this node's failure of each of `sinks`. Made once every node's raw
    part is there, so after each node's claim, and after each node read the failures of past tries: an
    older node takes this record for a failure of this try."""
    for k in range(x.nodes):
        theirs = x.read_json(x.claim_key(k)) if k != x.me else None
        if theirs is None or protocol_of(theirs) == PROTOCOL:
            continue  # this node, or a claim gone (removed by hand): nothing to compare
        older = k if _older(protocol_of(theirs)) else x.me
        err = FleetVersionError(
            f"step {x.step}: node {k} runs {describe(theirs)}, node {x.me} runs {describe(build())}: every "
            f"node of a step must speak one fleet protocol; node {older} runs the older build",
            path=f"{x.exchange.url}/{x.claim_key(k)}",
        )
        x.status(f"waiting for node {k} to run this node's fleet protocol ({err.message})", 1)
        for sink in sinks:
            x.record_failure(sink, err)
        raise err


def _older(theirs: object) -> bool:
    """Whether a claim's protocol is older than this node's (one that is no number: taken as newer)."""
    return type(theirs) is int and theirs < PROTOCOL
