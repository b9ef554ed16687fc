"""Remote retention of an fsspec sink: which published steps go (a pure plan), and deleting them so that the
prefix stays valid for readers at every moment.

A step on a sink is *complete* when its manifest exists: the publisher writes it only after every file is
uploaded and verified. The plan (per tree: the HF exports under `PREFIX/step-N/`, the raw steps under
`PREFIX/raw/step-N/`) keeps

- every step without a manifest (an upload in progress, or not verified): never touched;
- the step `latest` names, and everything newer than the newest complete step;
- the newest `keep_last` complete steps, and every step that is a multiple of `keep_every`;
- every step a `stagerd restore` is reading now (a lease under `PREFIX/restoring/`, younger than
  `LEASE_TTL_S`).

Deleting one step: a tombstone `stagerd.pruning` first, then the manifest (from here on the step is absent
to every reader), then its files, the tombstone last. A kill at any point leaves either a complete step or
one without a manifest; a later prune finishes a step whose tombstone it finds.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field

from stagerd.contract import layout
from stagerd.errors import ConfigError, SinkError
from stagerd.ops.crashpoints import crash_point
from stagerd.sinks.fetch import LATEST_NAME, RAW_DIR, RemoteStore, node_parts

log = logging.getLogger("stagerd.sinks.prune")

TOMBSTONE = "stagerd.pruning"
RESTORING_DIR = "restoring"
LEASE_TTL_S = 6 * 3600.0


@dataclass(frozen=True)
class RemoteStep:
    step: int
    complete: bool  # its manifest exists
    pruning: bool = False  # a killed prune's tombstone is there


@dataclass(frozen=True)
class Policy:
    keep_last: int | None = None
    keep_every: int | None = None

    def __post_init__(self) -> None:
        if self.keep_last is not None and self.keep_last < 1:
            raise ConfigError(
                f"remote keep_last must be 1 or more (the latest step stays), got {self.keep_last}"
            )
        if self.keep_every is not None and self.keep_every < 1:
            raise ConfigError(f"remote keep_every must be 1 or more, got {self.keep_every}")

    @property
    def active(self) -> bool:
        return self.keep_last is not None or self.keep_every is not None


def parse_policy(text: str) -> Policy:
    """`last=3,every=1000` (either part may be left out) as a Policy; a ValueError names what is wrong."""
    values: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",")):
        name, sep, number = part.partition("=")
        if not sep or name.strip() not in ("last", "every") or not number.strip().isdigit():
            raise ValueError(f"{text!r}: write last=N,every=M (either may be left out)")
        values[name.strip()] = int(number)
    try:
        return Policy(values.get("last"), values.get("every"))
    except ConfigError as e:
        raise ValueError(e.message) from None


@dataclass
class Decision:
    """One step's fate, with the reason a person reads in `prune --dry-run`."""

    tree: str  # "export" or "raw"
    step: int
    delete: bool
    reason: str


def plan_prune(
    steps: Iterable[RemoteStep], policy: Policy, latest: int | None, restoring: set[int]
) -> list[Decision]:
    """The fate of every step of one tree (see the module docstring); pure."""
    steps = sorted(steps, key=lambda s: s.step)
    complete = [s.step for s in steps if s.complete]
    newest = complete[-1] if complete else None
    keep_last = set(complete[-policy.keep_last :]) if policy.keep_last else set(complete)
    out = []
    for s in steps:
        if s.pruning and not s.complete:
            why, delete = "a killed prune's leftovers (no manifest)", True
        elif not s.complete:
            why, delete = "no manifest: not published or not verified", False
        elif s.step == latest:
            why, delete = "named by latest", False
        elif newest is None or s.step >= newest:
            why, delete = "no newer step is published and verified", False
        elif s.step in restoring:
            why, delete = "a restore is reading it", False
        elif s.step in keep_last:
            why, delete = (
                f"one of the newest {policy.keep_last}" if policy.keep_last else "keep_last unset",
                False,
            )
        elif policy.keep_every and s.step % policy.keep_every == 0:
            why, delete = f"a multiple of {policy.keep_every}", False
        else:
            why, delete = "older than what the policy keeps", True
        out.append(Decision("", s.step, delete, why))
    return out


def _tree_prefix(tree: str) -> str:
    return f"{RAW_DIR}/" if tree == "raw" else ""


def scan(store: RemoteStore, tree: str) -> tuple[list[RemoteStep], int | None]:
    """The steps of one tree on the store and the step its `latest` names."""
    base = store.path(_tree_prefix(tree).rstrip("/") or "")
    try:
        entries = store.fs.ls(base.rstrip("/") or "/", detail=False)
    except FileNotFoundError:
        return [], None
    steps = []
    for entry in entries:
        name = str(entry).rstrip("/").rsplit("/", 1)[-1]
        step = layout.parse_step_dir(name)
        if step is None:
            continue
        prefix = f"{_tree_prefix(tree)}{name}"
        complete = store.fs.exists(store.path(f"{prefix}/{layout.MANIFEST_NAME}"))
        if not complete and tree == "raw":  # node-local staging: complete once every node's part is
            complete = node_parts(store.sizes(prefix))[1]
        pruning = store.fs.exists(store.path(f"{prefix}/{TOMBSTONE}"))
        steps.append(RemoteStep(step, complete, pruning))
    latest_raw = store.read(f"{_tree_prefix(tree)}{LATEST_NAME}", limit=1024)
    latest = layout.parse_step_dir(latest_raw.decode(errors="replace").strip()) if latest_raw else None
    return steps, latest


def restoring_steps(store: RemoteStore, now: float | None = None) -> set[int]:
    """Steps with a live restore lease (both trees: a lease names the step)."""
    now = time.time() if now is None else now
    out = set()
    for rel, _size in store.sizes(RESTORING_DIR).items():
        step = layout.parse_step_dir(rel.split(".", 1)[0])
        data = store.read(f"{RESTORING_DIR}/{rel}", limit=4096)
        try:
            started = float(json.loads(data or b"{}").get("started", 0))
        except (ValueError, AttributeError):
            started = now  # unreadable: assume live until the TTL of its own writer cannot be known
        if step is not None and now - started < LEASE_TTL_S:
            out.add(step)
    return out


def _put(store: RemoteStore, key: str, data: bytes) -> None:
    path = store.path(key)
    if "file" in store.fs.protocol:
        store.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    store.fs.pipe_file(path, data)


@dataclass
class Lease:
    """A restore's lease on one step: prune leaves the step alone while the lease lives."""

    store: RemoteStore
    step: int
    key: str = field(init=False)

    def __post_init__(self) -> None:
        self.key = f"{RESTORING_DIR}/{layout.step_dir_name(self.step)}.{uuid.uuid4().hex}"

    def __enter__(self) -> Lease:
        try:
            _put(self.store, self.key, json.dumps({"started": time.time()}).encode())
        except OSError as e:  # a read-only credential can still restore; say that prune cannot see it
            log.warning(
                "cannot write the restore lease %s (%s); a prune meanwhile may remove the step",
                self.store.where(self.key),
                e,
            )
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.store.fs.rm_file(self.store.path(self.key))
        except OSError:
            pass


def delete_step(store: RemoteStore, prefix: str) -> None:
    """Tombstone, manifest, files, tombstone: the prefix is valid for a reader at every moment."""
    fs = store.fs
    _put(store, f"{prefix}/{TOMBSTONE}", b"")
    crash_point("prune.tombstone")
    manifests = [layout.MANIFEST_NAME] + [
        f"{n}/{layout.MANIFEST_NAME}" for n in node_parts(store.sizes(prefix))[0]
    ]
    for rel in manifests:  # every manifest before any file (node parts: each node's)
        if fs.exists(store.path(f"{prefix}/{rel}")):
            fs.rm_file(store.path(f"{prefix}/{rel}"))
    crash_point("prune.manifest")
    for rel in sorted(store.sizes(prefix)):
        if rel != TOMBSTONE:
            fs.rm_file(store.path(f"{prefix}/{rel}"))
    fs.rm_file(store.path(f"{prefix}/{TOMBSTONE}"))
    try:
        fs.rm(store.path(prefix), recursive=True)  # empty directories (file://); nothing on S3
    except (FileNotFoundError, OSError):
        pass


def prune(
    store: RemoteStore, policy: Policy, *, dry_run: bool = False, now: float | None = None
) -> list[Decision]:
    """Apply `policy` to both trees of `store`; returns every step's decision (deleted unless `dry_run`)."""
    if not policy.active:
        return []
    store.fs.invalidate_cache()  # s3fs caches listings: another writer may have published since
    restoring = restoring_steps(store, now)
    decisions = []
    for tree in ("export", "raw"):
        try:
            steps, latest = scan(store, tree)
        except OSError as e:
            raise SinkError(f"cannot list the steps: {type(e).__name__}: {e}", path=store.url) from None
        for d in plan_prune(steps, policy, latest, restoring):
            d.tree = tree
            decisions.append(d)
            if d.delete and not dry_run:
                prefix = f"{_tree_prefix(tree)}{layout.step_dir_name(d.step)}"
                try:
                    delete_step(store, prefix)
                except OSError as e:
                    raise SinkError(
                        f"cannot delete: {type(e).__name__}: {e}", path=store.where(prefix)
                    ) from None
                log.info(
                    "pruned %s step %d from %s (%s)",
                    tree,
                    d.step,
                    store.url,
                    d.reason,
                    extra={"step": d.step, "sink": store.url, "tree": tree},
                )
    return decisions
