"""Remote retention's plan: which published steps of one tree go. Pure: `prune.py` scans and deletes.

A step on a sink is *complete* when its manifest exists (for a node-locally staged raw step: every node's
part's manifest): the publisher writes it only after every file is uploaded and verified. The plan keeps

- every step without a manifest (an upload in progress, or not verified): never touched, unless it is a
  killed prune's leftovers (its claim is a dead prune's, or an older stagerd's tombstone);
- every step something still uses (`busy`): a live prune deleting it, a fleet build that may still read
  its node parts;
- the step `latest` names, and everything newer than the newest complete step;
- the newest `keep_last` complete steps, and every step that is a multiple of `keep_every` (alone,
  `keep_every` keeps only those, the newest complete step and `latest`'s);
- every step a `stagerd restore` is reading now (a live lease, `leases.py`);
- every complete step another publisher's claim names (`claims.whose`, read by the caller: an input here),
  where the caller judges for one ROOT: never deleted and never counted, so a ROOT keeping 1 keeps its own
  newest whatever another ROOT sharing the prefix published since.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from stagerd.errors import ConfigError
from stagerd.sinks.claims import FOREIGN, OWN, UNKNOWN

FOREIGN_REASON = "published by another ROOT: never deleted or counted by this one"
UNKNOWN_REASON = "its publisher is not recorded and another ROOT publishes here: never deleted by this one"


@dataclass(frozen=True)
class RemoteStep:
    step: int
    complete: bool  # its manifest exists
    pruning: bool = False  # a killed prune's claim (or an older stagerd's tombstone) is there
    busy: str | None = None  # why nothing may touch it now
    owner: str = OWN  # claims.OWN, FOREIGN or UNKNOWN: who published it, for the ROOT judging
    publisher: str = ""  # who published it, for a person: "HOST:ROOT (id ...)", "" where not read


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

    def keeps(self, step: int, steps: Sequence[int]) -> bool:
        """Whether this policy alone would keep `step` among `steps` (ascending): the newest, one of the
        newest `keep_last`, or a multiple of `keep_every` (`plan_prune`'s reasons to keep a step)."""
        if not self.active or not steps or step >= steps[-1]:
            return True
        return (self.keep_last is not None and step in steps[-self.keep_last :]) or (
            self.keep_every is not None and step % self.keep_every == 0
        )


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

    tree: str  # "export", "raw" or "fleet"
    step: int
    delete: bool
    reason: str
    publisher: str = ""  # RemoteStep.publisher
    foreign: bool = False  # another publisher's: left alone (logged once by the daemon)
    # multipart uploads pending under the step aborted with it (`pending_uploads.py`; a dry run: would
    # be); None: the store would not list them
    uploads: int | None = 0


def plan_prune(
    steps: Iterable[RemoteStep],
    policy: Policy,
    latest: int | None,
    restoring: set[int],
    *,
    shared: bool = False,
) -> list[Decision]:
    """The fate of every step of one tree (see the module docstring). `shared`: another ROOT's steps are
    under this prefix too; then a step whose publisher is UNKNOWN is left alone as well. Without another
    ROOT there, UNKNOWN steps are this ROOT's as they always were: a fleet's export an older leader committed
    with no claim, and the steps an older stagerd published, must still go, or an upgraded user's bucket
    grows for ever; with one, they may be its, and leaving a step costs space where deleting it loses it."""
    steps = sorted(steps, key=lambda s: s.step)
    foreign = {s.step for s in steps if s.complete and _foreign(s, shared)}
    complete = [s.step for s in steps if s.complete and s.step not in foreign]
    newest = complete[-1] if complete else None
    keep_last = set(complete[-policy.keep_last :]) if policy.keep_last else set()
    out = []
    for s in steps:
        if s.busy is not None:
            why, delete = s.busy, False
        elif s.pruning and not s.complete:
            why, delete = "a killed prune's leftovers (no manifest)", True
        elif not s.complete:
            why, delete = "no manifest: not published or not verified", False
        elif s.step in foreign:
            why, delete = FOREIGN_REASON if s.owner == FOREIGN else UNKNOWN_REASON, False
        elif s.step == latest:
            why, delete = "named by latest", False
        elif newest is None or s.step >= newest:
            why, delete = "no newer step is published and verified", False
        elif s.step in restoring:
            why, delete = "a restore is reading it", False
        elif s.step in keep_last:
            why, delete = f"one of the newest {policy.keep_last}", False
        elif policy.keep_every and s.step % policy.keep_every == 0:
            why, delete = f"a multiple of {policy.keep_every}", False
        else:
            why, delete = "older than what the policy keeps", True
        out.append(Decision("", s.step, delete, why, s.publisher, s.step in foreign))
    return out


def _foreign(s: RemoteStep, shared: bool) -> bool:
    return s.owner == FOREIGN or (shared and s.owner == UNKNOWN)
