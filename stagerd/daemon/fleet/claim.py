"""A node's claim of its part of a fleet step on the exchange (`fleet/step-N/node-K.json`, naming its ROOT,
its save, its settings and its build's fleet protocol: `version.py`), and its wait until every other
node's claim names the same settings."""

from __future__ import annotations

import json
from typing import Any

from stagerd.daemon.fleet.exchange import StepExchange
from stagerd.daemon.fleet.records import settings_errors
from stagerd.daemon.fleet.version import build, same_build
from stagerd.errors import ConfigError, FleetNodeConflictError, FleetWaitError, StepConflictError
from stagerd.sinks.fetch import step_prefix


def claim(x: StepExchange, root_id: str, save: str, settings: dict[str, Any]) -> None:
    """Claim node `x.me` for this ROOT and save (a conditional create); another ROOT's claim is
    `FleetNodeConflictError`, another save's `StepConflictError`; this ROOT's claim with other settings
    (restarted with fixed ones) or of another build (restarted on an upgraded stagerd) is rewritten, for
    the other nodes to compare."""
    key, step, me, nodes = x.claim_key(x.me), x.step, x.me, x.nodes
    body = {"root": root_id, "node": me, "nodes": nodes, "save": save, **settings, **build()}
    mine = json.dumps(body).encode()
    if x.create(key, mine):
        return
    theirs = x.read_json(key) or {}
    if theirs.get("root") != root_id and theirs.get("save", save) != save:
        # another ROOT's claim of another save: not a second daemon of this run, but another run's step
        raise FleetNodeConflictError(
            f"step {step}: node {me} of {nodes} is already claimed by another run's save of this step "
            f"(ROOT {theirs.get('root')!r}, this one is {root_id!r})",
            path=x.exchange.url + "/" + key,
            hint="two runs meet on one exchange, each with its own step numbers: give each run its own "
            "sink prefix, or every node of each run its own --exchange URL; this run's export of the step "
            f"then goes on with `stagerd retry ROOT --step {step}` on every node",
        )
    if theirs.get("root") != root_id:
        raise FleetNodeConflictError(
            f"step {step}: node {me} of {nodes} is already claimed by another ROOT "
            f"({theirs.get('root')!r}, this one is {root_id!r})",
            path=x.exchange.url + "/" + key,
            hint="give each node its own STAGERD_NODE_ID (0..N-1), one daemon per node and ROOT; if this "
            "ROOT made that claim under its old identity (its daemon's log says its fleet-root-id was "
            "'taken for a copy': ROOT restored, moved to another disk, or its host renamed), remove "
            f"{key} from the exchange and run `stagerd retry ROOT --step {step}`",
        )
    if theirs.get("save", save) != save:  # a claim by an older stagerd names no save
        # A run restarted from an earlier checkpoint saved this step again: the exchange's records
        # (which files are built, and `done.json`) are the other save's and would pass for this one's.
        raise StepConflictError(
            f"step {step}: the exchange's {x.base}/ belongs to another save of this step",
            path=x.exchange.url + "/" + key,
            hint=f"to publish the new save, remove step {step} from each sink and {x.base}/ and "
            f"{step_prefix(step, raw=True)}/ from the exchange, then run "
            f"`stagerd retry ROOT --step {step}`; to keep what was published, delete the new save",
        )
    if theirs.get("settings", settings["settings"]) != settings["settings"] or not same_build(theirs):
        # restarted with other settings, or on another stagerd: the others compare these
        x.exchange.backend.write(key, mine)


def wait_agreed(x: StepExchange, settings: dict[str, Any]) -> None:
    """Every other node's claim names this node's settings. A node restarted with fixed ones rewrites
    its claim, so a difference is waited out first; one that stays is the ConfigError."""
    found: list[tuple[int, ConfigError]] = []

    def agreed() -> bool:
        keys = {k: x.claim_key(k) for k in range(x.nodes) if k != x.me}
        claims = {k: x.read_json(key) or {} for k, key in keys.items()}
        where = f"{x.exchange.url}/{x.base}"
        found[:] = settings_errors(x.step, x.me, claims, settings["settings"], where)
        return not found

    try:
        x.wait(agreed, lambda: f"waiting for node {found[0][0]} to run with this node's settings")
    except FleetWaitError as e:
        if found:
            raise found[0][1] from e
        raise
