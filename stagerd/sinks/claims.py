"""Who may change a step's prefix on a store: its claim object, `claims/step-N` beside the steps
(`raw/claims/step-N`, and `raw/claims/step-N.node-K-of-M` for a node's raw part: `claim_key`), so a step's
directory holds exactly what was published.

Publishes and prunes change a step's prefix; two at once (two jobs sharing a prefix, a job restarted on
another node while the old daemon still publishes, two prunes) must never both change it. The claim decides,
with the store's own conditional writes (`RemoteStore.put_if`, `Backend.create`):

- **A publisher** creates it (S3 `If-None-Match: *`, file:// `link()`) together with the step's first
  requests, naming itself by host, the real path of what it publishes and its ROOT's identity
  (`publish_claim`, `contract/root_id.py`): the same publisher restarted on the same host owns it again,
  after a reboot too, any other does not (two containers sharing a host name see their own directories at
  one path). It also names the ROOTs it resumed from (`contract/lineage.py`), which a restore of the step
  records. Until it is known to hold it, a publisher writes nothing but create-only PUTs of free keys.
  It never releases it: the claim stays as long as the step, so a step's prefix has one publisher for
  its whole life.
  - Another publisher's claim, and a manifest: the manifests are compared (the same files: done; other
    files: `SinkConflictError`). No manifest: `StepClaimedError` (retryable): the holder is still
    publishing, or died before its commit (then an operator deletes the claim object; see the hint).
  - What a loser created on free keys before it knew is deleted once the winner's manifest is there, only
    where the manifest does not name it and it still holds the loser's version (S3 `If-Match` on its
    ETag): the same bytes have the same ETag, so the winner may have kept such an object as its own.
- **A fleet's leader** creates it for an export the nodes build together before any node writes under the
  step (`daemon/fleet/stake.py`; each owner first sees it recorded on the exchange and held by the sink),
  naming every node's ROOT (`fleet_claim`), so each node's retention counts the export as its own and
  every other ROOT's leaves it (`whose`).
- **A prune** replaces the claim by its own, conditionally on the version it listed (S3 `If-Match`, or
  `If-None-Match: *` where a step has none; file:// under `flock`), before it deletes anything of a step,
  and deletes it last. A publisher meanwhile finds a prune's claim (`StepClaimedError`, retried), and a
  second prune's replace fails, so it leaves the step to the first (each step is counted once).
- **A killed prune's** claim is taken over the same way by the next prune, which finishes the deletion:
  killed means its pid is gone on this host in this pid namespace (the claim names it: `pidns`; the
  containers of one pod share a host name, not their pids), or it is older than `PRUNE_STALE_S` by the
  store's clock. An older stagerd's prune claim names no namespace: its age alone counts.

An S3 store that ignores these conditions (2xx, the key overwritten or deleted) is found by a probe
(`s3/conditions.py`): there a publisher's claim is exists-then-put, a loser deletes nothing, and a prune
is refused (`ConditionsIgnoredError`) before it changes anything.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import uuid
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from stagerd.contract import layout, lineage
from stagerd.contract.manifest import ExportManifest
from stagerd.contract.root_id import ROOT_ID, root_id
from stagerd.errors import RestoreError, SinkConflictError, StepClaimedError
from stagerd.errors.base import bounded
from stagerd.ops.processes import PID_NS, pid_alive
from stagerd.sinks.objects import MAX_CLAIM_BYTES, same_files
from stagerd.sinks.remote import RemoteStore

CLAIMS_DIR = "claims"
PUBLISH, PRUNE = "publish", "prune"
PRUNE_STALE_S = 600.0  # a prune deletes a step in seconds; one this old by the store's clock is dead
# A fleet's claim names every node's ROOT (33 bytes each in JSON) and a publisher's the ROOTs it resumed
# from: 4 kB was 110 nodes, and past it every prune of the prefix failed. 128 kB holds 3,000 nodes.
CLAIM_ANCESTORS = 16  # the newest ROOTs a publisher resumed from, named in its claims


def claim_key(prefix: str) -> str:
    """The claim of the step prefix `[TREE/]step-N[/PART]`: `[TREE/]claims/step-N[.PART]`."""
    parts = prefix.split("/")
    i = next(i for i, p in enumerate(parts) if layout.parse_step_dir(p) is not None)
    base = "/".join([*parts[:i], CLAIMS_DIR])
    return f"{base}/{'.'.join(parts[i:])}"


@dataclass(frozen=True)
class Claim:
    kind: str  # PUBLISH or PRUNE ("unknown": unreadable)
    owner: str  # a publisher: host:real path of its local tree; a prune: host:pid:random
    host: str
    pid: int
    # a publisher: its ROOT's identity; in an older stagerd's claim ROOT's "device:inode", its step
    # directory's inode (no colon), or ""
    tree: str = ""
    # a fleet export's leader: the ROOT identities of every node that built it (`fleet_claim`); written
    # only where there are some, so a single publisher's claim is the bytes an older stagerd wrote
    trees: tuple[str, ...] = ()
    # a publisher: the ROOTs its own resumed from (`contract/lineage.py`), newest last; written only where
    # there are some. A restore of its step records them with it, so a run moved twice keeps pruning all.
    ancestors: tuple[str, ...] = ()
    # never written: the names older stagerds gave this publisher's tree (ROOT's "device:inode" and the
    # step directory's inode, now); None outside ROOT's layout, where host and path alone decide
    former: frozenset[str] | None = field(default=frozenset(), compare=False)
    # a prune: its pid namespace (`ops.processes.PID_NS`), without which its pid says nothing here; written
    # only by a prune, so a publisher's claim is the bytes an older stagerd wrote
    pidns: str | None = None

    def encode(self) -> bytes:
        d = asdict(self)
        del d["former"]
        for optional in ("trees", "ancestors"):
            if not d[optional]:
                del d[optional]
        if d["pidns"] is None:
            del d["pidns"]
        return (json.dumps(d, sort_keys=True) + "\n").encode()

    def published_from(self) -> tuple[str, Path]:
        """A publisher's host and the local tree it published (a step's `export/`, its directory, ...)."""
        host, _, path = self.owner.partition(":")
        return host, Path(path)

    def describe(self) -> str:
        if self.kind == PUBLISH:
            return f"a publish of {self.owner} (pid {self.pid})"
        if self.kind == PRUNE:
            return f"a prune on {self.host} (pid {self.pid})"
        return f"an unreadable claim ({self.owner})"


def step_dir_of(local: Path) -> Path:
    """The step directory of a published local tree: a step's `export/` is its step's."""
    return local.parent if local.name == layout.EXPORT_DIR else local


def publish_claim(local_root: Path) -> Claim:
    """This publisher's claim: the same on a restart of the same tree on the same host. Host and path
    alone are not one tree: two containers sharing the host's name (host networking) see their own ROOTs at
    one path, so ROOT's identity tells them apart. ROOT, not the step directory: a step saved again (a new
    directory) is published by the same daemon, which must find its claim its own. Only in ROOT's layout
    (a step's `export/`, or the step directory itself) or beside an `export/` of the user's, whose parent
    may be made again between a failed publish and its rerun.

    The identity is `ROOT/.stagerd/fleet-root-id` (`root_id`, made there if need be) where ROOT has the
    daemon's `.stagerd/`: ROOT's device number changes with a reboot that renumbers its disk, and its inode
    alone is no identity (two mount points' roots are both inode 2 on many filesystems). Elsewhere (nothing
    is written into a directory of the user's), or where the id cannot be written, it is ROOT's
    "device:inode", as an older stagerd named every ROOT.

    `former` holds the names older stagerds gave this tree, so that a publish in flight across an upgrade
    finds its claim its own: ROOT's "device:inode", and the step directory's inode (the stagerd before
    that; its own rule, host, path and that inode). Outside ROOT's layout host and path alone decide, for
    every claim, as they do for this stagerd's own there."""
    host = socket.gethostname()
    real = Path(os.path.realpath(local_root))
    step_dir = step_dir_of(real)
    tree = ""
    ancestors: tuple[str, ...] = ()
    former: frozenset[str] | None = None
    if layout.parse_step_dir(step_dir.name) is not None or real.name == layout.EXPORT_DIR:
        root, former = step_dir.parent, frozenset()
        with contextlib.suppress(OSError):
            st = os.stat(root)
            tree = f"{st.st_dev}:{st.st_ino}"
            former = frozenset({tree})
            # retention judges a step whose local directory its own keep-last deleted: ROOT still names it
            with contextlib.suppress(OSError):
                former |= {str(os.stat(step_dir).st_ino)}
            if (root / layout.STATE_DIR).is_dir():
                tree = root_id(root)
                ancestors = lineage.ancestors(root)[-CLAIM_ANCESTORS:]
    return Claim(PUBLISH, f"{host}:{real}", host, os.getpid(), tree, ancestors=ancestors, former=former)


def fleet_claim(step_dir: Path, trees: Iterable[str]) -> Claim:
    """The claim a fleet's leader makes before its nodes write an export they build together: its own
    publish claim (`publish_claim` of its step), naming in `trees` the ROOT identities of every node (the
    leader's among them). Each node's daemon applies remote retention to the sink, so `whose` judges the
    export its own on each of them; an older stagerd reads `tree` alone (the leader's) and so keeps the
    export on every other ROOT, the fleet's other nodes included."""
    mine = publish_claim(step_dir)
    ids = tuple(dict.fromkeys(t for t in trees if ROOT_ID.fullmatch(t)))
    return replace(mine, trees=ids)


def fleet_owned(data: bytes | None, mine: Claim) -> bool:
    """Whether the claim read back (`data`) is this fleet leader's (`fleet_claim`), made by an earlier try
    of its commit: ROOT's identity decides, as it does for the fleet's node claims (a pod recreated under
    another host name is the same leader); without one, the publisher's own rule (`owned_by`)."""
    theirs = decode(data)
    if theirs is None or theirs.kind != PUBLISH:
        return False
    return (bool(ROOT_ID.fullmatch(mine.tree)) and theirs.tree == mine.tree) or owned_by(data, mine)


def prune_claim() -> Claim:
    host = socket.gethostname()
    return Claim(PRUNE, f"{host}:{os.getpid()}:{uuid.uuid4().hex[:12]}", host, os.getpid(), pidns=PID_NS)


def decode(data: bytes | None) -> Claim | None:
    if data is None:
        return None
    try:
        d = json.loads(data)
        trees, ancestors = d.get("trees", []), d.get("ancestors", [])
        if not isinstance(trees, list) or not isinstance(ancestors, list):
            raise TypeError("trees")
        return Claim(
            str(d["kind"]),
            str(d["owner"]),
            str(d.get("host", "")),
            int(d.get("pid", 0)),
            str(d.get("tree", "")),
            tuple(str(t) for t in trees),
            tuple(a for a in ancestors if isinstance(a, str) and ROOT_ID.fullmatch(a))[-CLAIM_ANCESTORS:],
            pidns=None if d.get("pidns") is None else str(d["pidns"]),
        )
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError):
        # a pid of Infinity (int() overflows) or arrays nested 100k deep (the JSON decoder recurses) stopped
        # every prune of the prefix with a traceback: a claim is anyone's bytes on a shared store
        return Claim("unknown", repr(data[:80]), "", 0)


def read_claim(store: RemoteStore, key: str) -> bytes | None:
    """The claim at `key` (None: there is none). One larger than `MAX_CLAIM_BYTES` reads as unreadable
    (an "unknown" claim, judged as retention judges any it cannot read): it must not stop the prune of
    every other step."""
    try:
        return store.read(key, limit=MAX_CLAIM_BYTES)
    except RestoreError:
        return b""


def owned_by(data: bytes | None, mine: Claim) -> bool:
    """Whether the claim read back (`data`) is held by the publisher `mine` (itself, or its restart)."""
    theirs = decode(data)
    if theirs is None or not theirs.kind == mine.kind == PUBLISH or theirs.owner != mine.owner:
        return False
    if not theirs.tree or mine.former is None:  # no tree named, or outside ROOT's layout: host and path
        return True
    return theirs.tree == mine.tree or theirs.tree in mine.former  # an older stagerd's names for it too


OWN, FOREIGN, UNKNOWN = "own", "foreign", "unknown"  # who published a step, as retention judges it


@dataclass(frozen=True)
class Publisher:
    """A ROOT as retention sees the steps on a store: its daemon may delete only the steps it published."""

    host: str
    roots: frozenset[Path]  # real paths of the trees it publishes from: ROOT (and `--adopt`'s export root)
    tree: str  # ROOT's identity (`root_id`), or its "device:inode" where ROOT has no `.stagerd/`
    # the identities of the ROOTs this ROOT resumed from through `stagerd restore` (`contract/lineage.py`):
    # the same run, so their steps are counted and pruned as this ROOT's
    ancestors: frozenset[str] = frozenset()

    def describe(self) -> str:
        return f"{self.host}:{','.join(sorted(map(str, self.roots)))}"


def publisher_of(root: Path, *others: Path) -> Publisher:
    """ROOT's `Publisher`, named as `publish_claim` names it in the claims it writes."""
    real = Path(os.path.realpath(root))
    st = os.stat(real)
    ancestors: frozenset[str] = frozenset()
    if (real / layout.STATE_DIR).is_dir():
        tree = root_id(real)
        ancestors = frozenset(lineage.ancestors(real)) - {tree}
    else:
        tree = f"{st.st_dev}:{st.st_ino}"
    roots = frozenset({real, *(Path(os.path.realpath(o)) for o in others)})
    return Publisher(socket.gethostname(), roots, tree, ancestors)


def whose(data: bytes | None, me: Publisher) -> str:
    """Who published the step whose claim read back is `data`: `me` (OWN), another ROOT (FOREIGN), or
    UNKNOWN where the claim cannot tell (none: an older fleet leader's commit, a stagerd before claims; a
    prune's; unreadable; an older stagerd's name of this host and path that cannot be checked any more: the
    step's inode once its directory is gone, ROOT's "device:inode" after a reboot renumbered its disk).

    A ROOT's identity decides alone: it stays with ROOT moved to another path, and two ROOTs at one path
    (two containers) have two. A fleet export's claim names every node's (`fleet_claim`): it is OWN for each
    node of that fleet. A ROOT this one resumed from (`me.ancestors`) is this one: the same run.
    Without one, the publisher's own rule does (`owned_by`, older claims included), on the claim this ROOT
    would write for the path the claim names."""
    theirs = decode(data)
    if theirs is None or theirs.kind != PUBLISH:
        return UNKNOWN
    fleet = {t for t in (theirs.tree, *theirs.trees) if ROOT_ID.fullmatch(t)} if theirs.trees else set()
    if fleet:  # a fleet export: each of its nodes published it
        return OWN if fleet & {me.tree, *me.ancestors} else FOREIGN
    if ROOT_ID.fullmatch(theirs.tree):
        return OWN if theirs.tree == me.tree or theirs.tree in me.ancestors else FOREIGN
    host, local = theirs.published_from()
    if host != me.host or step_dir_of(local).parent not in me.roots:
        return FOREIGN
    return OWN if owned_by(data, publish_claim(local)) else UNKNOWN


def prune_is_dead(claim: Claim, age: float | None) -> bool:
    """A prune's claim that no live prune holds: its pid is gone on this host and in this pid namespace,
    or it is `PRUNE_STALE_S` old by the store's clock (`age`). A publisher's claim never is (see the
    module docstring)."""
    if claim.kind != PRUNE:
        return False
    here = claim.host == socket.gethostname() and claim.pidns == PID_NS
    if here and claim.pid > 0 and not pid_alive(claim.pid):
        return True
    return age is not None and age > PRUNE_STALE_S


NAMED_CHARS = 160  # of a host or a path a claim names, in a message: a claim is anyone's bytes


def publisher_named(data: bytes | None) -> str | None:
    """Who published a step, as its claim (`data`) names them: the host and ROOT (the parent of a step
    directory) or, outside ROOT's layout, the directory published; each printable and bounded. None for no
    claim, a prune's, or one that cannot be read."""
    held = decode(data)
    if held is None or held.kind != PUBLISH:
        return None
    host, local = held.published_from()
    step_dir = step_dir_of(local)
    if layout.parse_step_dir(step_dir.name) is not None:
        return f"host {bounded(host, NAMED_CHARS)}, ROOT {bounded(str(step_dir.parent), NAMED_CHARS)}"
    return f"host {bounded(host, NAMED_CHARS)}, directory {bounded(str(local), NAMED_CHARS)}"


def claimed_error(where: str, data: bytes | None, step: int) -> StepClaimedError:
    held = decode(data)
    who = held.describe() if held is not None else "another publisher"
    return StepClaimedError(
        f"step {step} is claimed by {who}, with no manifest yet; nothing of this publish was written there",
        path=where,
    )


def check_same(remote: ExportManifest, local: ExportManifest, where: str, claim: bytes | None = None) -> None:
    """A `SinkConflictError` where the step's manifest at `where` is another upload: it names the publisher
    the step's `claim` names (another's, where this publish does not hold it), and says what to do."""
    if remote.step == local.step and same_files(remote, local):
        return
    who = publisher_named(claim)
    by = f"; it was published by another run ({who})" if who else ""
    raise SinkConflictError(
        f"the remote manifest for step {remote.step} lists different files or hashes than the local "
        f"export for step {local.step}{by}",
        path=where,
        hint="another run publishes to this prefix: give each run its own prefix (a --sink URL of its "
        "own); the step there is another upload, so inspect it before deleting anything",
    )
