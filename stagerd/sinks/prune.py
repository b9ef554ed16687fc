"""Remote retention of an fsspec sink: scan the trees, plan (`prune_plan.py`), delete exact keys, with the
prefix valid for readers at every moment and never a key of a step another process is changing.

- **Scan**: one literal listing each (`step-*` of the export tree, of `raw/`, of both `claims/`, of
  `fleet/`, and `restoring/`), never a pattern; the claims of steps without a manifest are read to tell
  a killed prune's leftovers from a publish in progress. A node-locally staged raw step whose fleet build
  has not recorded `fleet/step-N/done.json` is busy: the build may still read its parts.
- **Delete one step** (`delete_step`): take every claim of the step (`claims.py`: the step's, and each
  node part's) by a conditional replace on the version listed, or stop if one changed (a publisher or
  another prune holds it: not counted); then the manifests (from here the step is absent to every
  reader), then a fresh listing's files by exact key (`DeleteObjects` on S3, `rm_file` elsewhere), with a
  raw step's `fleet/step-N/` records (re-listed under the claims: the step is left if they changed); the
  claims last, each only while it is still ours. A kill at any
  point leaves a complete step or one without a manifest under a prune's claim, which the next prune
  takes over and finishes; a publisher meanwhile finds that claim and waits (`StepClaimedError`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from stagerd.contract import layout
from stagerd.errors import SinkError
from stagerd.ops.crashpoints import crash_point
from stagerd.sinks import claims
from stagerd.sinks.fetch import LATEST_NAME, RAW_DIR, node_parts
from stagerd.sinks.leases import RESTORING_DIR, Lease, live_leases
from stagerd.sinks.prune_plan import Decision, Policy, RemoteStep, parse_policy, plan_prune
from stagerd.sinks.remote import RemoteStore, StoredObject

__all__ = ["Decision", "Lease", "Policy", "RemoteStep", "parse_policy", "plan_prune", "prune"]

log = logging.getLogger("stagerd.sinks.prune")

TOMBSTONE = "stagerd.pruning"  # an older stagerd's mark of a prune in progress
FLEET_DIR = "fleet"
FLEET_DONE = "done.json"  # written by the fleet's leader once nothing reads the step's raw parts again


@dataclass
class Tree:
    """One tree's steps as listed: each step's objects by name relative to the step's prefix, and the
    claims under the tree's `claims/` (`step-N`, `step-N.node-K-of-M`)."""

    name: str  # "export", "raw"
    base: str  # "" or "raw/"
    steps: dict[int, dict[str, StoredObject]] = field(default_factory=dict)
    claims: dict[str, StoredObject] = field(default_factory=dict)

    def prefix(self, step: int) -> str:
        return f"{self.base}{layout.step_dir_name(step)}"

    def claims_of(self, step: int) -> list[tuple[str, StoredObject | None]]:
        """(key, as listed) of the step's claims: its own first (None: it has none yet), then its parts'."""
        name = layout.step_dir_name(step)
        own = f"{self.base}{claims.CLAIMS_DIR}/{name}"
        parts = sorted(r for r in self.claims if r.startswith(name + "."))
        return [(own, self.claims.get(name))] + [
            (f"{self.base}{claims.CLAIMS_DIR}/{r}", self.claims[r]) for r in parts
        ]


def _by_step(objects: dict[str, StoredObject]) -> dict[int, dict[str, StoredObject]]:
    out: dict[int, dict[str, StoredObject]] = {}
    for rel, o in objects.items():
        name, sep, rest = rel.partition("/")
        step = layout.parse_step_dir(name)
        if step is not None and sep and rest:
            out.setdefault(step, {})[rest] = o
    return out


def _complete(tree: Tree, objs: dict[str, StoredObject]) -> bool:
    if layout.MANIFEST_NAME in objs:
        return True
    return tree.name == "raw" and node_parts(objs)[1]  # node-local staging: every node's part


def _state(store: RemoteStore, tree: Tree, step: int, now: float) -> tuple[bool, str | None]:
    """(a killed prune's leftovers, busy reason) of a step without a manifest: read its claims."""
    listed = [(key, obj) for key, obj in tree.claims_of(step) if obj is not None]
    if not listed:
        return TOMBSTONE in tree.steps.get(step, {}), None  # an older stagerd's killed prune, or nothing
    for key, obj in listed:
        held = claims.decode(store.read(key, limit=4096))
        if held is None or held.kind != claims.PRUNE:
            return False, None  # a publish in progress: never touched
        if not claims.prune_is_dead(held, None if obj.mtime is None else now - obj.mtime):
            return False, f"{held.describe()} is deleting it"
    return True, None


def scan(
    store: RemoteStore, tree: Tree, fleet: dict[int, dict[str, StoredObject]], now: float
) -> tuple[list[RemoteStep], int | None]:
    """The steps of one tree (those with objects, and those with only a claim left) and `latest`'s."""
    claimed = {s for r in tree.claims if (s := layout.parse_step_dir(r.split(".", 1)[0])) is not None}
    steps = []
    for step in sorted(set(tree.steps) | claimed):
        objs = tree.steps.get(step, {})
        complete = _complete(tree, objs)
        pruning, busy = (False, None) if complete else _state(store, tree, step, now)
        if busy is None and tree.name == "raw" and node_parts(objs)[0]:
            records = fleet.get(step, {})
            if records and FLEET_DONE not in records:
                busy = f"a fleet build may still read its node parts (no {FLEET_DIR}/step-N/{FLEET_DONE})"
        steps.append(RemoteStep(step, complete, pruning, busy))
    latest_raw = store.read_latest(f"{tree.base}{LATEST_NAME}")  # another tool's names no step
    latest = layout.parse_step_dir(latest_raw.decode(errors="replace").strip()) if latest_raw else None
    return steps, latest


def delete_step(
    store: RemoteStore, tree: Tree, step: int, now: float, records: dict[str, StoredObject] | None = None
) -> bool:
    """Delete one step (module docstring); a raw step's fleet `records`, as listed, go with its files.
    False, with nothing deleted, when one of its claims, files or records changed since the listing or a
    live prune holds it."""
    prefix, listed = tree.prefix(step), tree.steps.get(step, {})
    fleet = f"{FLEET_DIR}/{layout.step_dir_name(step)}"
    mine = claims.prune_claim().encode()
    taken: list[tuple[str, bytes | None, str]] = []  # (claim, what it held, our version), in order
    for key, obj in tree.claims_of(step):
        before = None
        if obj is not None:
            found = store.read_tagged(key)
            if found is None or found[1] != obj.tag:
                return _give_back(store, taken) and False  # changed since the listing
            held = claims.decode(found[0])
            age = None if obj.mtime is None else now - obj.mtime
            if held is not None and held.kind == claims.PRUNE and not claims.prune_is_dead(held, age):
                return _give_back(store, taken) and False  # a live prune is deleting it
            before = found[0]
        tag = store.put_if(key, mine, None if obj is None else obj.tag)
        if tag is None:
            return _give_back(store, taken) and False
        taken.append((key, before, tag))
    if _tags(store.objects(prefix)) != _tags(listed) or (
        records and _tags(store.objects(fleet)) != _tags(records)
    ):
        # Deleted (another prune finished it and gave its claim back) or written since the listing: a
        # stale listing decides nothing, and counting it would count one step twice.
        return _give_back(store, taken) and False
    crash_point("prune.tombstone")
    manifests = [layout.MANIFEST_NAME, *(f"{n}/{layout.MANIFEST_NAME}" for n in node_parts(listed)[0])]
    store.delete([f"{prefix}/{m}" for m in manifests])  # every manifest before any file
    crash_point("prune.manifest")
    extra = [f"{fleet}/{rel}" for rel in sorted(records or {})]
    store.delete([*(f"{prefix}/{rel}" for rel in sorted(store.objects(prefix))), *extra])
    ours = _give_back(store, taken, delete=True)
    store.remove_empty_dirs(prefix)  # file://: the step's directories, now empty
    return ours


def _tags(objects: dict[str, StoredObject]) -> dict[str, str | None]:
    return {rel: o.tag for rel, o in objects.items()}


def _give_back(
    store: RemoteStore, taken: list[tuple[str, bytes | None, str]], *, delete: bool = False
) -> bool:
    """Release the claims taken, the step's own last: deleted (`delete`: the step is gone) or put back as
    they were. Each only while it is still ours; True if every one was (else a prune that took this one
    for dead took it over, and finishes the step)."""
    ours = True
    for key, before, tag in reversed(taken):
        if delete or before is None:
            ours = store.delete_if(key, tag) and ours
        else:
            ours = store.put_if(key, before, tag) is not None and ours
    return ours


def prune(
    store: RemoteStore, policy: Policy, *, dry_run: bool = False, now: float | None = None
) -> list[Decision]:
    """Apply `policy` to both trees of `store`; returns every step's decision (deleted unless `dry_run`; a
    step another process held meanwhile is reported kept, so two prunes at once count each step once).
    `now`: the store's time (its own clock when not given)."""
    if not policy.active:
        return []
    try:
        now = store.clock() if now is None else now
        trees = [Tree("export", ""), Tree("raw", f"{RAW_DIR}/")]
        for tree in trees:
            tree.steps = _by_step(store.objects(tree.base.rstrip("/"), start="step-"))
            tree.claims = store.objects(f"{tree.base}{claims.CLAIMS_DIR}", start="step-")
        fleet = _by_step(store.objects(FLEET_DIR, start="step-"))
        restoring = live_leases(store.objects(RESTORING_DIR), now)
        plans = [(tree, *scan(store, tree, fleet, now)) for tree in trees]
    except OSError as e:
        raise SinkError(f"cannot list the steps: {type(e).__name__}: {e}", path=store.url) from None
    decisions = []
    for tree, steps, latest in plans:
        for d in plan_prune(steps, policy, latest, restoring):
            d.tree = tree.name
            decisions.append(d)
            if d.delete and not dry_run:
                _delete(store, tree, d, now, fleet)
    decisions += _orphan_records(store, fleet, trees[1], plans[1][1], dry_run)
    return decisions


def _delete(
    store: RemoteStore, tree: Tree, d: Decision, now: float, fleet: dict[int, dict[str, StoredObject]]
) -> None:
    prefix = tree.prefix(d.step)
    records = fleet.get(d.step, {}) if tree.name == "raw" else {}
    try:
        done = delete_step(store, tree, d.step, now, records)
        if records:
            store.remove_empty_dirs(f"{FLEET_DIR}/{layout.step_dir_name(d.step)}")
    except OSError as e:
        raise SinkError(f"cannot delete: {type(e).__name__}: {e}", path=store.where(prefix)) from None
    if not done:
        d.delete, d.reason = False, "another prune or a publisher held it meanwhile: left to it"
        return
    log.info(
        "pruned %s step %d from %s (%s)",
        tree.name,
        d.step,
        store.url,
        d.reason,
        extra={"step": d.step, "sink": store.url, "tree": tree.name},
    )


def _orphan_records(
    store: RemoteStore,
    fleet: dict[int, dict[str, StoredObject]],
    raw: Tree,
    raw_steps: list[RemoteStep],
    dry_run: bool,
) -> list[Decision]:
    """`fleet/step-N/` records whose raw step is gone (pruned by hand, or by an older stagerd): deleted once
    their build recorded it is done and a newer raw step is complete; else kept (a build in progress).
    Each only while it is the version listed, `done.json` last: a record written since (a build of a step
    saved again) stays, and so does `done.json`, so the next prune judges the step afresh."""
    complete = [s.step for s in raw_steps if s.complete]
    newest = complete[-1] if complete else None
    out = []
    for step, records in sorted(fleet.items()):
        if step in raw.steps:
            continue  # they go with their raw step
        gone = FLEET_DONE in records and newest is not None and step < newest
        why = "its raw step is gone and its build is done" if gone else "a fleet build may still use it"
        out.append(Decision("fleet", step, gone, why))
        if gone and not dry_run:
            base = f"{FLEET_DIR}/{layout.step_dir_name(step)}"
            last = sorted(records, key=lambda r: (r == FLEET_DONE, r))
            if not all(store.delete_if(f"{base}/{r}", records[r].tag) for r in last):
                out[-1].delete, out[-1].reason = False, "a record changed since the listing: left"
            store.remove_empty_dirs(base)
    return out
