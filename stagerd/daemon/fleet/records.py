"""What the fleet's nodes write on the exchange about themselves and their files, and the checks that
they agree (the same settings, the same plan, the same save).

A record (`fleet/step-N/done/SINK/NAME.json`) says a file is uploaded to a sink: its size, sha256, the
store's checksum, its owner, and the sha256 of its header as the owner's plan writes it, so the leader
commits only files built from its own plan (a daemon run with other export settings builds a file of
the same name, even of the same size, with other bytes). `save_of` is what every node's marker of one save
holds alike, so a node part of another save is never built into this one's export.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stagerd.contract import commit_marker
from stagerd.contract.commit_marker import is_int
from stagerd.daemon.fleet.build import Artefact
from stagerd.engine.file_header import file_header
from stagerd.engine.plan_types import OutputFile
from stagerd.errors import ConfigError, HubPlanError, SinkConflictError
from stagerd.sinks.fsspec import FsspecSink
from stagerd.sinks.objects import Uploaded


def sink_id(url: str) -> str:
    """A sink's name in the exchange's record keys: every node passes the same --sink URLs."""
    return hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]


_SHA256 = re.compile(r"[0-9a-f]{64}")


def uploaded(d: dict[str, Any] | None) -> Uploaded:
    assert d is not None  # waited for, and checked (`same_plans`)
    return Uploaded(d["rel"], int(d["size"]), d["sha256"], d.get("checksum"))


def record_bytes(up: Uploaded, node: int, planned: dict[str, object]) -> bytes:
    return json.dumps(
        {
            "rel": up.rel,
            "sha256": up.sha256,
            "checksum": up.checksum,
            "owner": node,
            **planned,
            "size": up.size,
        }
    ).encode()


def planned_file(art: Artefact, f: OutputFile) -> dict[str, object]:
    """What the plan says file `f` is: its size and the sha256 of its header (names, dtypes, shapes,
    offsets), so that a file built under other export settings is told apart even at the same size."""
    header = file_header(art.plan, art.plan.files.index(f))
    return {"size": f.size, "header": hashlib.sha256(header).hexdigest()}


def same_plan(record: dict[str, Any] | None, planned: dict[str, object]) -> bool:
    """A record of the file this plan builds (a record by an older stagerd names no header)."""
    return (
        record is not None
        and record.get("size") == planned["size"]
        and record.get("header", planned["header"]) == planned["header"]
    )


def is_record_of(record: dict[str, Any], name: str) -> bool:
    """`record` has the fields and types `record_bytes` writes, and is of file `name`."""
    sha, checksum = record.get("sha256"), record.get("checksum")
    return (
        record.get("rel") == name
        and is_int(record.get("size"))
        and isinstance(sha, str)
        and _SHA256.fullmatch(sha) is not None
        and (checksum is None or isinstance(checksum, str))
    )


def plan_text(d: dict[str, Any] | None) -> str:
    d = d or {}
    return f"{d.get('size')} bytes, header sha256 {str(d.get('header'))[:12]}"


def save_of(m: commit_marker.CommitMarker) -> dict[str, Any]:
    """What every node's marker of one save holds alike (all but its own files and node id)."""
    d = m.to_json()
    d.pop("files")
    d.pop("staging_node")
    return d


def save_id(m: commit_marker.CommitMarker) -> str:
    """`save_of` as one digest, alike on every node of one save: a record one node makes of its save."""
    return hashlib.sha256(json.dumps(save_of(m), sort_keys=True).encode()).hexdigest()


def settings_of(
    sinks: Sequence[FsspecSink],
    dtype: str | None,
    keep_dtype: str | None,
    max_shard_size: int,
    mapping: Path | None,
    hub: bool,
    hubs: Sequence[str] = (),
) -> dict[str, Any]:
    """A claim's settings: the sinks (their record ids, in order), the Hub sinks' (where there are any:
    each node's lanes wait for the leader's publish to its own, which a leader without that sink never
    makes), and what decides the plan."""
    hub_ids = {"hubs": [sink_id(u) for u in hubs]} if hubs else {}
    return {
        "settings": {
            "sinks": [sink_id(s.url) for s in sinks],
            "dtype": dtype,
            "keep_dtype": keep_dtype,
            "max_shard_size": max_shard_size,
            "mapping": None if mapping is None else _sha256_of(mapping),
            "hub": hub,
            **hub_ids,
        }
    }


_NEWER = ("hubs",)  # settings a claim by an older stagerd does not name: compared only where both do


def _sha256_of(mapping: Path) -> str:
    try:
        return hashlib.sha256(mapping.read_bytes()).hexdigest()
    except OSError as e:  # as `engine.export.mapped_plan` says it
        raise HubPlanError(f"cannot read the key mapping: {e.strerror}", path=mapping) from None


def settings_errors(
    step: int, me: int, claims: dict[int, dict[str, Any]], mine: dict[str, Any], where: str
) -> list[tuple[int, ConfigError]]:
    """Each node whose claim (`claims`, by node) names other settings than node `me`'s, with its error;
    `where`: the step's folder on the exchange. A claim by an older stagerd names none: not compared."""
    out = []
    for k, claim in sorted(claims.items()):
        theirs = claim.get("settings")
        if theirs is None:
            continue
        if not isinstance(theirs, dict):  # damaged: every setting differs (was a raw AttributeError)
            theirs = {}
        both = {n for n in _NEWER if n in theirs and n in mine}
        theirs = {n: v for n, v in theirs.items() if n not in _NEWER or n in both}
        ours = {n: v for n, v in mine.items() if n not in _NEWER or n in both}
        if theirs == ours:
            continue
        diff = ", ".join(
            f"{n}: {theirs.get(n)!r} against {v!r}" for n, v in ours.items() if theirs.get(n) != v
        )
        err = ConfigError(
            f"step {step}: node {k}'s daemon runs with other settings than node {me}'s ({diff})",
            path=f"{where}/node-{k:05d}.json",
            hint="every node's daemon must run with the same --sink URLs (in order, Hub sinks too), --dtype, "
            "--keep-dtype, "
            "--max-shard-size and --mapping; fix it and restart it (its claim is rewritten), then run "
            f"`stagerd retry ROOT --step {step}` on every node",
        )
        out.append((k, err))
    return out


def same_plans(
    step: int,
    owner: dict[str, int],
    planned: dict[str, dict[str, object]],
    got: dict[str, dict[str, Any] | None],
    where: str,
) -> None:
    """Raise if a file's record (`got`, by file) is of another plan than `planned`: its owner built other
    bytes under the same name than the leader's index describes. `where`: the records' folder."""
    for n, rec in got.items():
        if rec is not None and not is_record_of(rec, n):
            # its `rel` and `sha256` go into the manifest as they are: another file's name there lists
            # that file twice and this one never, and verification by name and size passes
            raise SinkConflictError(
                f"step {step}: {n}.json on the exchange is no record of {n} (rel "
                f"{str(rec.get('rel'))[:80]!r}, sha256 {str(rec.get('sha256'))[:16]!r}, size "
                f"{str(rec.get('size'))[:20]})",
                path=f"{where}{n}.json",
                hint=f"stagerd did not write it; remove it from the exchange (node {owner[n]} builds and "
                f"uploads {n} again), then run `stagerd retry ROOT --step {step}` on every node",
            )
        if rec is not None and not same_plan(rec, planned[n]):
            raise ConfigError(
                f"step {step}: node {owner[n]} built {n} from another plan than node 0's "
                f"({plan_text(rec)} against {plan_text(planned[n])})",
                path=f"{where}{n}.json",
                hint="every node's daemon must run with the same stagerd, --dtype, --keep-dtype, "
                f"--max-shard-size and --mapping; fix them, delete {where.rsplit('/done/', 1)[0]}/done/ "
                f"from the exchange (every node rebuilds its files), then run `stagerd retry ROOT --step "
                f"{step}` on every node",
            )
