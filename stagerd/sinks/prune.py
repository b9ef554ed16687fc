"""Remote retention of an fsspec sink: scan the trees, plan (`prune_plan.py`), delete exact keys, with the
prefix valid for readers at every moment and never a key of a step another process is changing.

- **Scan**: one literal listing each (`step-*` of the export tree, of `raw/`, of both `claims/`, of
  `fleet/`, and `restoring/`), never a pattern; the claims of steps without a manifest are read to tell
  a killed prune's leftovers from a publish in progress. A node-locally staged raw step whose fleet build
  has not recorded `fleet/step-N/done.json` is busy: the build may still read its parts.
- **Delete one step** (`delete_step`): take every claim of the step (`claims.py`: the step's, and each
  node part's) by a conditional replace on the version listed, or stop if one changed (a publisher or
  another prune holds it: not counted); then `restoring/` once more, and the step is left (its claims
  given back) where a restore's lease on it was written since the scan; then the manifests (from here the
  step is absent to every reader), then on S3 the multipart uploads pending under the step's prefix
  (`pending_uploads.py`: each by key and UploadId), then a fresh listing's files by exact key
  (`DeleteObjects` on S3, `rm_file` elsewhere), with a raw step's `fleet/step-N/` records (re-listed under
  the claims: the step is left if they changed); on file:// the step's emptied directories; the claims
  last, each only while it is still ours (a claim gone before the directories would leave a kill between
  an empty directory nothing lists again). A kill at any point leaves a complete step or one without a
  manifest under a prune's claim, which the next prune takes over and finishes; a publisher meanwhile
  finds that claim and waits (`StepClaimedError`). A restore writes its lease, then reads the step's claim
  (`leases.refuse_pruning`): a lease written before the prune's second look at `restoring/` keeps the
  step, and one written after it finds the prune's claim and stops before reading anything
  (`StepVanishedError`), so no restore reads a step that a prune deletes.
- **Whose** (`Owner`, `step_owners.py`): the claim of every complete step is read (once per version) and
  judged for the ROOT pruning (`claims.whose`), an input of the plan: a daemon's retention deletes only its
  own ROOT's steps. A prefix two runs share by mistake must never cost one run the other's checkpoints.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

from stagerd.contract import layout
from stagerd.errors import SinkError, SymlinkError
from stagerd.ops.crashpoints import crash_point, delay_point
from stagerd.sinks import claims
from stagerd.sinks.fetch import LATEST_NAME, RAW_DIR, node_parts
from stagerd.sinks.leases import RESTORING_DIR, Lease, live_leases
from stagerd.sinks.pending_uploads import abort_pending
from stagerd.sinks.prune_plan import Decision, Policy, RemoteStep, parse_policy, plan_prune
from stagerd.sinks.remote import RemoteStore, StoredObject
from stagerd.sinks.step_owners import Owner

__all__ = ["Decision", "Lease", "Owner", "Policy", "RemoteStep", "parse_policy", "plan_prune", "prune"]

log = logging.getLogger("stagerd.sinks.prune")

TOMBSTONE = "stagerd.pruning"  # an older stagerd's mark of a prune in progress
FLEET_DIR = "fleet"
FLEET_DONE = "done.json"  # written by the fleet's leader once nothing reads the step's raw parts again
# a node part's claim is `step-N.node-K-of-M` (`claims.claim_key`, `fetch.node_part`); any other name
# under `claims/` (a person's copy, `step-N.bak`) is no claim: never read, replaced or deleted
_PART_CLAIM = re.compile(r"node-[0-9]{5}-of-[0-9]{5}")


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
        parts = sorted(r for r in self.claims if _claim_step(r) == step and "." in r)
        return [(own, self.claims.get(name))] + [
            (f"{self.base}{claims.CLAIMS_DIR}/{r}", self.claims[r]) for r in parts
        ]


def _owner(store: RemoteStore, tree: Tree, step: int, owner: Owner) -> tuple[str, str]:
    """Who published a complete step: its claim's publisher, or for a node-locally staged raw step its
    parts' (the step is this ROOT's if one part is: each node of one fleet prunes it)."""
    found = [owner.claim(store, key, obj) for key, obj in tree.claims_of(step) if obj is not None]
    kinds = {k for k, _ in found}
    kind = next((k for k in (claims.OWN, claims.FOREIGN) if k in kinds), claims.UNKNOWN)
    return kind, ", ".join(sorted({w for _, w in found if w}))


def _claim_step(rel: str) -> int | None:
    """The step whose claim (or node part's claim) `rel` under `claims/` is; None: not a claim's name."""
    name, dot, part = rel.partition(".")
    return layout.parse_step_dir(name) if not dot or _PART_CLAIM.fullmatch(part) else None


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
        held = claims.decode(claims.read_claim(store, key))
        if held is None or held.kind != claims.PRUNE:
            return False, None  # a publish in progress: never touched
        if not claims.prune_is_dead(held, None if obj.mtime is None else now - obj.mtime):
            return False, f"{held.describe()} is deleting it"
    return True, None


def scan(
    store: RemoteStore,
    tree: Tree,
    fleet: dict[int, dict[str, StoredObject]],
    now: float,
    owner: Owner | None = None,
) -> tuple[list[RemoteStep], int | None]:
    """The steps of one tree (those with objects, and those with only a claim left) and `latest`'s."""
    claimed = {s for r in tree.claims if (s := _claim_step(r)) is not None}
    steps = []
    for step in sorted(set(tree.steps) | claimed):
        objs = tree.steps.get(step, {})
        complete = _complete(tree, objs)
        pruning, busy = (False, None) if complete else _state(store, tree, step, now)
        if busy is None and tree.name == "raw" and node_parts(objs)[0]:
            records = fleet.get(step, {})
            if records and FLEET_DONE not in records:
                busy = f"a fleet build may still read its node parts (no {FLEET_DIR}/step-N/{FLEET_DONE})"
        kind, who = _owner(store, tree, step, owner) if complete and owner is not None else (claims.OWN, "")
        steps.append(RemoteStep(step, complete, pruning, busy, kind, who))
    latest_raw = store.read_latest(f"{tree.base}{LATEST_NAME}")  # another tool's names no step
    latest = layout.parse_step_dir(latest_raw.decode(errors="replace").strip()) if latest_raw else None
    return steps, latest


def delete_step(
    store: RemoteStore,
    tree: Tree,
    step: int,
    now: float,
    records: dict[str, StoredObject] | None = None,
    decision: Decision | None = None,
) -> bool:
    """Delete one step (module docstring); a raw step's fleet `records`, as listed, go with its files,
    and so do the multipart uploads pending under either (`decision.uploads`: how many). False, with
    nothing deleted, when one of its claims, files or records changed since the listing or a live prune
    holds it."""
    prefix, listed = tree.prefix(step), tree.steps.get(step, {})
    fleet = f"{FLEET_DIR}/{layout.step_dir_name(step)}"
    bad = store.undeletable(
        [*(f"{prefix}/{rel}" for rel in listed), *(f"{fleet}/{r}" for r in records or {})]
    )
    if bad:  # before its claims: a step this store cannot delete whole is left whole, manifest and all
        raise _Undeletable(f"{store.where(bad[0])} has glob characters, which this store's delete may expand")
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
    if step in live_leases(store.objects(RESTORING_DIR), now):  # written since the scan: see the docstring
        _give_back(store, taken)
        raise _Leased
    crash_point("prune.tombstone")
    delay_point("prune.tombstone")
    manifests = [layout.MANIFEST_NAME, *(f"{n}/{layout.MANIFEST_NAME}" for n in node_parts(listed)[0])]
    store.delete([f"{prefix}/{m}" for m in manifests])  # every manifest before any file
    crash_point("prune.manifest")
    # under the claims, so no publisher of the step writes there; before its files and records, so a
    # prune killed before it is done lists the same prefixes when it is finished
    aborted = abort_pending(store, _prefixes(tree, step, records))
    if decision is not None:
        decision.uploads = aborted
    extra = [f"{fleet}/{rel}" for rel in sorted(records or {})]
    store.delete([*(f"{prefix}/{rel}" for rel in sorted(store.objects(prefix))), *extra])
    crash_point("prune.files")
    store.remove_empty_dirs(prefix)  # file://: the step's directories, now empty
    ours = _give_back(store, taken, delete=True)
    return ours


class _Leased(Exception):  # not an error: `_delete` reports the step kept
    """A restore's lease on the step appeared after the scan: the step is left (`delete_step`)."""


class _Undeletable(Exception):  # not an error: `_delete` reports the step kept, and why
    """A key of the step the store cannot delete exactly (`RemoteStore.undeletable`): the step is left."""


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
    store: RemoteStore,
    policy: Policy,
    *,
    owner: Owner | None = None,
    dry_run: bool = False,
    now: float | None = None,
) -> list[Decision]:
    """Apply `policy` to both trees of `store`; returns every step's decision (deleted unless `dry_run`; a
    step another process held meanwhile is reported kept, so two prunes at once count each step once).
    `owner`: the ROOT whose steps alone may go, and each step's publisher is read (None: every step counts,
    none is read). `now`: the store's time (its own clock when not given)."""
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
        plans = [(tree, *scan(store, tree, fleet, now, owner)) for tree in trees]
    except OSError as e:
        raise SinkError(f"cannot list the steps: {type(e).__name__}: {e}", path=store.url) from None
    shared = any(s.complete and s.owner == claims.FOREIGN for _, steps, _ in plans for s in steps)
    decisions = []
    for tree, steps, latest in plans:
        for d in plan_prune(steps, policy, latest, restoring, shared=shared):
            d.tree = tree.name
            decisions.append(d)
            delay_point("prune.decided")
            if d.delete and not dry_run:
                _delete(store, tree, d, now, fleet)
            elif d.delete:  # reported, never aborted
                records = fleet.get(d.step) if tree.name == "raw" else None
                d.uploads = abort_pending(store, _prefixes(tree, d.step, records), dry_run=True)
            elif d.foreign and owner is not None and not dry_run:
                _left_alone(store, owner, d)
    decisions += _orphan_records(store, fleet, trees[1], plans[1][1], dry_run)
    return decisions


def _delete(
    store: RemoteStore, tree: Tree, d: Decision, now: float, fleet: dict[int, dict[str, StoredObject]]
) -> None:
    prefix = tree.prefix(d.step)
    records = fleet.get(d.step, {}) if tree.name == "raw" else {}
    try:
        done = delete_step(store, tree, d.step, now, records, d)
        if records:
            store.remove_empty_dirs(f"{FLEET_DIR}/{layout.step_dir_name(d.step)}")
    except OSError as e:
        raise SinkError(f"cannot delete: {type(e).__name__}: {e}", path=store.where(prefix)) from None
    except _Leased:
        d.delete, d.reason = False, "a restore is reading it"
        return
    except (
        SymlinkError,
        _Undeletable,
    ) as e:  # a link out of a file:// sink, a name a store would expand: left
        d.delete, d.reason = False, str(e)
        log.warning("%s step %d on %s left: %s", tree.name, d.step, store.url, e, extra={"step": d.step})
        return
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


def _prefixes(tree: Tree, step: int, records: dict[str, StoredObject] | None) -> list[str]:
    """The prefixes whose pending multipart uploads go with a step: its own, and its fleet records' if any."""
    return [tree.prefix(step), *([f"{FLEET_DIR}/{layout.step_dir_name(step)}"] if records else [])]


def _left_alone(store: RemoteStore, owner: Owner, d: Decision) -> None:
    """Another ROOT's step, logged once per step for as long as this `owner` lives (a daemon)."""
    if (store.url, d.tree, d.step) in owner.warned:
        return
    owner.warned.add((store.url, d.tree, d.step))
    log.warning(
        "%s step %d on %s: %s (%s); remote retention leaves it alone. Hint: two runs share this prefix (give "
        "each run its own sink prefix), or this run resumed on a new ROOT without `stagerd restore` (a "
        "plain `stagerd prune URL --keep-last N` counts every step under the prefix); see every step's "
        "publisher with `stagerd prune URL --keep-last N --dry-run`",
        d.tree,
        d.step,
        store.url,
        d.reason,
        d.publisher or "no publisher recorded",
        extra={"step": d.step, "sink": store.url, "tree": d.tree},
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
