"""This ROOT's identity (`ROOT/.stagerd/fleet-root-id`), stable across restarts and reboots, and new in a
copy of ROOT. A fleet node's claim of a step on the exchange names it, so that two ROOTs acting as one node
id are told apart (`FleetNodeConflictError`); so does a publisher's claim of a step on a sink
(`sinks/claims.py`), so that two ROOTs at one path on one host name (two containers) are two publishers,
and a publisher restarted after a reboot that renumbered its disk is still the same one.

An id alone would travel with a copy of ROOT (`cp -a` to another node or path), and the copy would pass for
the original. So the file also records ROOT's inode: when it no longer matches, this ROOT is taken for a
copy and makes a fresh id (with a warning). Left out, as they change for the same directory: its path
(`mv`, another mount point), its device number (a reboot may renumber a disk) and the host name (a pod
recreated under a new name, on the same node-local ROOT, must keep its in-flight fleet steps). A copy the
inode cannot tell (a block-level clone of a disk) keeps the id; it then acts for the same saves, and a
save of its own is told apart by the claim's save identity (`StepConflictError`)."""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import uuid
from pathlib import Path
from typing import Any

from stagerd.contract import layout
from stagerd.contract.json_fields import loads

ROOT_ID_NAME = "fleet-root-id"

log = logging.getLogger("stagerd.fleet")
# An identity's form (uuid4's hex), also the whole file as an older stagerd wrote it; no other name of a
# ROOT travels between nodes, and an older stagerd's names of a tree have a colon or none.
ROOT_ID = re.compile(r"[0-9a-f]{32}")
_lock = threading.Lock()


def where(root: Path) -> dict[str, Any]:
    """What tells this ROOT directory from a copy of it."""
    return {"ino": os.stat(root).st_ino}


def root_id(root: Path) -> str:
    """ROOT's identity, made once per ROOT directory (and again in a copy of it)."""
    path = root / ".stagerd" / ROOT_ID_NAME
    with _lock:  # one process's threads make one id
        here = where(root)
        try:
            text = path.read_text().strip()
        except FileNotFoundError:
            text = None
        found = _parse(text)
        made = None if found is None else found.get("where")
        if found is not None and (made is None or made.get("ino") == here["ino"]):
            if made != here:  # written before ids recorded where: adopt it for this ROOT
                _write(path, found["id"], here)
            return str(found["id"])
        if found is not None or text is not None:
            made = made if found is not None else "unreadable"
            log.warning(
                "ROOT %s: %s was made for another ROOT directory (%s; this one is %s): taken for a copy, "
                "this ROOT gets a new identity; a fleet step it claimed before is refused "
                "(FleetNodeConflictError), and so is a step whose publish it began (StepClaimedError)",
                root,
                path,
                made,
                here,
            )
        new = uuid.uuid4().hex
        if text is not None:
            _write(path, new, here)
            return new
        try:  # the first id: another process making it now must not have its id replaced by ours
            _write(path, new, here, exclusive=True)
        except FileExistsError:
            found = _parse(path.read_text().strip())
            if found is None:
                raise
            return str(found["id"])
        return new


def _parse(text: str | None) -> dict[str, Any] | None:
    if text is None:
        return None
    if ROOT_ID.fullmatch(text):
        return {"id": text, "where": None}
    try:
        d = loads(text)
    except ValueError:
        return None
    if not isinstance(d, dict) or not isinstance(d.get("id"), str) or not ROOT_ID.fullmatch(d["id"]):
        return None
    if not isinstance(d.get("where"), dict):
        return None
    return d


def _write(path: Path, id_: str, here: dict[str, Any], *, exclusive: bool = False) -> None:
    data = json.dumps({"id": id_, "where": here}).encode() + b"\n"
    layout.write_bytes_atomic(path, data, exclusive=exclusive)
