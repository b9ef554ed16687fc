"""Whose step a raw restore brought back: the ROOT identities its claims name on the sink, recorded in the
restoring ROOT's lineage (`contract/lineage.py`) so that its daemon's retention counts and prunes them as
its own. A resumed run then keeps `--remote-keep-last N` across a move to another node.

Nothing here fails a restore: a step whose claim is missing (published by a stagerd before claims, or a
fleet leader's commit), unreadable, or names no ROOT identity (an older stagerd's) records nothing, with one
warning; the previous ROOT's steps then stay until a person prunes them.
"""

from __future__ import annotations

import logging
from pathlib import Path

from stagerd.contract import lineage
from stagerd.errors import StagerdError
from stagerd.sinks import claims
from stagerd.sinks.remote import RemoteStore

log = logging.getLogger("stagerd.restore")


def publishers(store: RemoteStore, parts: list[str]) -> list[str]:
    """The ROOT identities named by the claims of a raw step's `parts` (the step's prefix, or each node's
    part of a node-locally staged step): each publisher, after the ROOTs its claim says it resumed from;
    in order, without repeats; [] where none names one."""
    found: list[str] = []
    for part in parts:
        try:
            held = claims.decode(claims.read_claim(store, claims.claim_key(part)))
        except (OSError, StagerdError):
            continue
        if held is None or held.kind != claims.PUBLISH or not claims.ROOT_ID.fullmatch(held.tree):
            continue  # no claim, a prune's, unreadable, or an older stagerd's name that stays on its node
        for ident in (*held.ancestors, held.tree):  # whom it had resumed from, then itself: newest last
            if ident not in found:
                found.append(ident)
    return found


def record(root: Path, step: int, ids: list[str], sink: str) -> list[str]:
    """Record in ROOT's lineage the publishers `ids` of the restored `step` (`publishers`) other than ROOT
    itself; the ids recorded. Called holding ROOT's lock, before the step's marker is written: a committed
    restored step then has its publisher recorded, and running the restore again records it once."""
    from stagerd.contract.root_id import root_id

    if not ids:
        log.warning(
            "step %d on %s: its claim is missing or names no ROOT identity, so its publisher is not "
            "recorded; the daemon of %s will not prune the steps published before this restore. Hint: "
            "`stagerd prune %s --keep-last N --dry-run` lists every step with its publisher",
            step,
            sink,
            root,
            sink,
            extra={"step": step, "sink": sink},
        )
        return []
    try:
        me = root_id(root)
        return [i for i in ids if i != me and lineage.record(root, i, step=step, sink=sink)]
    except OSError as e:
        log.warning(
            "cannot record in %s whose step %d this ROOT resumed from: %s; the daemon will not prune the "
            "steps published before this restore. Hint: prune them by hand with `stagerd prune %s "
            "--keep-last N`",
            lineage.lineage_path(root),
            step,
            e.strerror or e,
            sink,
            extra={"step": step, "sink": sink},
        )
        return []
