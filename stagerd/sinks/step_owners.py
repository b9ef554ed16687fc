"""Whose a step on a sink is: the ROOT a prune deletes for, and each claim read back judged for it
(`claims.whose`), remembered per claim version, so that a daemon's retention deletes only its own ROOT's
steps and names the publisher of each other one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from stagerd.contract import layout
from stagerd.sinks import claims
from stagerd.sinks.remote import RemoteStore, StoredObject

_JUDGED_MAX = 100_000  # claims judged a daemon remembers: one per complete step and part it has seen


@dataclass
class Owner:
    """The ROOT a prune deletes for (`publisher`; None: every step counts, as for a person cleaning a
    prefix), and what it keeps between prunes: the judgement of each claim version read, and the steps
    already logged as another's."""

    publisher: claims.Publisher | None = None
    warned: set[tuple[str, str, int]] = field(default_factory=set)
    # (claim key, version) -> judgement: a claim does not change while its step is complete, so retention
    # after each publish reads only the new steps' claims
    judged: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict)

    @classmethod
    def of(cls, root: Path, *others: Path) -> Owner:
        return cls(claims.publisher_of(root, *others))

    def judge(self, data: bytes | None) -> tuple[str, str]:
        """(claims.OWN, FOREIGN or UNKNOWN; who, for a person) of one claim read back."""
        held = claims.decode(data)
        who = _who(held) if held is not None and held.kind == claims.PUBLISH else ""
        if self.publisher is None:
            return claims.OWN, who
        return claims.whose(data, self.publisher), who

    def claim(self, store: RemoteStore, key: str, obj: StoredObject) -> tuple[str, str]:
        k = (key, obj.tag or "")
        got = self.judged.get(k) if obj.tag else None
        if got is None:
            if len(self.judged) > _JUDGED_MAX:
                self.judged.clear()
            got = self.judged[k] = self.judge(claims.read_claim(store, key))
        return got


def _who(claim: claims.Claim) -> str:
    """A publisher's claim as a person knows it: HOST:ROOT, and ROOT's identity where it names one; a fleet
    export's, its leader's and how many nodes built it."""
    host, local = claim.published_from()
    step_dir = claims.step_dir_of(local)
    root = step_dir.parent if layout.parse_step_dir(step_dir.name) is not None else step_dir
    fleet = f", a fleet of {len(claim.trees)} nodes" if claim.trees else ""
    return f"{host}:{root}" + (
        f" (id {claim.tree[:8]}{fleet})" if claims.ROOT_ID.fullmatch(claim.tree) else ""
    )
