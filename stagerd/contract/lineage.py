"""The earlier ROOTs this ROOT resumed from (`ROOT/.stagerd/lineage.json`), so that remote retention goes on
across a node move.

A job rescheduled onto another node gets a fresh node-local ROOT, and with it a new identity
(`root_id.py`): every step the earlier ROOT published would be another publisher's to the new daemon, never
counted or deleted. `stagerd restore` of a raw step into ROOT records here the identity named by that
step's claim on the sink (`sinks/restored_from.py`); retention takes the steps of every ROOT listed for this
ROOT's own (`sinks/claims.py`, `Publisher.ancestors`). A ROOT that never restored has no file, and a run
sharing the prefix by mistake stays another publisher.

A publisher's claims also name the newest ROOTs it had resumed from (`claims.CLAIM_ANCESTORS`), so a restore
records those too and a run moved twice prunes what its first ROOT published. Each restore adds its ids
(again: moved to the end), and only the newest `MAX_ANCESTORS` stay, so a file written by hand or a run
moved a thousand times stays small. An unreadable file reads as no ancestors (with
a warning): retention then keeps more, never less.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from stagerd.contract import layout
from stagerd.contract.json_fields import loads
from stagerd.contract.regular_file import open_regular
from stagerd.contract.root_id import ROOT_ID

LINEAGE_NAME = "lineage.json"
LINEAGE_FORMAT = "stagerd.lineage/1"
MAX_ANCESTORS = 64
MAX_LINEAGE_BYTES = 64 << 10  # 64 entries of a few hundred bytes each

log = logging.getLogger("stagerd.lineage")


def lineage_path(root: Path) -> Path:
    return root / layout.STATE_DIR / LINEAGE_NAME


def ancestors(root: Path) -> tuple[str, ...]:
    """The ids of the ROOTs this ROOT resumed from, oldest first; () where it never restored a step."""
    return tuple(e["id"] for e in _entries(lineage_path(root)))


def record(root: Path, root_id: str, *, step: int, sink: str) -> bool:
    """Add the ROOT `root_id` (the publisher of `step`, restored from `sink`: a URL without secrets) to this
    ROOT's lineage, written atomically; False if it is not a ROOT's identity (nothing written). The caller
    holds ROOT's lock, so no other writer changes the file meanwhile."""
    if not ROOT_ID.fullmatch(root_id):
        return False
    path = lineage_path(root)
    kept = [e for e in _entries(path) if e["id"] != root_id]
    kept.append({"id": root_id, "step": step, "sink": sink})
    layout.write_json_atomic(path, {"format": LINEAGE_FORMAT, "ancestors": kept[-MAX_ANCESTORS:]})
    return True


def _entries(path: Path) -> list[dict[str, Any]]:
    try:
        with open_regular(path) as f:
            data = f.read(MAX_LINEAGE_BYTES + 1)
    except FileNotFoundError:
        return []
    except OSError as e:
        return _unreadable(path, f"{type(e).__name__}: {e.strerror or e}")
    if len(data) > MAX_LINEAGE_BYTES:
        return _unreadable(path, f"larger than {MAX_LINEAGE_BYTES} bytes")
    try:
        d = loads(data)
    except ValueError:
        return _unreadable(path, "not JSON")
    listed = d.get("ancestors") if isinstance(d, dict) and d.get("format") == LINEAGE_FORMAT else None
    if not isinstance(listed, list):
        return _unreadable(path, f"not a {LINEAGE_FORMAT} file")
    found = [e for e in listed if isinstance(e, dict) and ROOT_ID.fullmatch(str(e.get("id", "")))]
    return found[-MAX_ANCESTORS:]


def _unreadable(path: Path, why: str) -> list[dict[str, Any]]:
    log.warning(
        "%s: %s; remote retention counts only this ROOT's own steps, not those of the ROOTs it resumed "
        "from. Hint: a `stagerd restore` into this ROOT writes it again; delete the file to silence this",
        path,
        why,
    )
    return []
