"""The commit marker, `stagerd.commit.json`: a step exists only once it is durable. Its fields and their
checks, its compact JSON (`marker_json.py`), its reading and writing, its identity, and the check of the
files it lists. This module must not import torch: the daemon reads markers on every scan.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stagerd.contract.hub_plan import HubPlan
from stagerd.contract.layout import (
    MARKER_NAME,
    MAX_STEP,
    check_file_tree,
    parse_step_dir,
    safe_relpath,
    write_bytes_atomic,
)
from stagerd.contract.marker_json import (
    decode_plan,
    decode_tensors,
    decode_weight_map,
    encode_plan,
    encode_tensors,
    encode_weight_map,
)
from stagerd.contract.regular_file import open_regular
from stagerd.errors import HubPlanError, MarkerError, ShardError

MARKER_FORMAT = "stagerd.commit/1"
MAX_MARKER_BYTES = 64 << 20
# Each daemon of a node-locally staged step keeps a few objects per node (a claim key, a load count): a
# marker naming 10^9 nodes took the daemon's memory; 65536 nodes are half a million GPUs.
MAX_STAGING_NODES = 1 << 16


@dataclass(frozen=True)
class StagedFile:
    """One file of a staged step, relative to the step directory, with its size in bytes."""

    path: str
    size: int


@dataclass(frozen=True)
class TensorInfo:
    """The global dtype (safetensors name) and shape of one saved tensor."""

    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class CommitMarker:
    """`stagerd.commit.json`: a step exists only once this is durable."""

    step: int
    world_size: int
    files: tuple[StagedFile, ...]
    created: float = field(default_factory=time.time)
    reference_index: dict[str, str] | str | None = None
    dtype: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, TensorInfo] | None = None
    # Node-local staging on several nodes: this marker lists only the files of staging node
    # `staging_node` of `staging_nodes`; the step is whole only with every node's marker. 0 of 1 = all files.
    staging_node: int = 0
    staging_nodes: int = 1
    # How the staged tensors become the checkpoint's (contract/hub_plan.py): None writes them as staged.
    hub_plan: HubPlan | None = None
    # A PEFT model's adapter-only artefact (export/adapter/adapter_model.safetensors), planned the same way.
    adapter_plan: HubPlan | None = None
    format: str = MARKER_FORMAT

    def to_json(self) -> dict[str, Any]:
        """The marker's JSON, its tensors and plans in the compact form of `marker_json.py`."""
        names = [] if self.tensors is None else list(self.tensors)
        tensors = None
        if self.tensors is not None:
            tensors = encode_tensors(names, ((v.dtype, v.shape) for v in self.tensors.values()))
        return {
            "format": self.format,
            "step": self.step,
            "world_size": self.world_size,
            "files": [{"path": f.path, "size": f.size} for f in self.files],
            "created": self.created,
            "reference_index": encode_weight_map(self.reference_index, names, self.hub_plan)
            if isinstance(self.reference_index, dict)
            else self.reference_index,
            "dtype": self.dtype,
            "metadata": copy.deepcopy(self.metadata),
            "tensors": tensors,
            "staging_node": self.staging_node,
            "staging_nodes": self.staging_nodes,
            "hub_plan": None if self.hub_plan is None else encode_plan(self.hub_plan, names),
            "adapter_plan": None if self.adapter_plan is None else encode_plan(self.adapter_plan, names),
        }

    @classmethod
    def from_json(cls, d: Any, *, path: object = None) -> CommitMarker:
        """Parse and validate a marker, in either form (`marker_json.py`); any defect is a MarkerError."""
        try:
            if not isinstance(d, dict) or d.get("format") != MARKER_FORMAT:
                raise MarkerError(f"not a {MARKER_FORMAT} marker", path=path)
            step, ws = d["step"], d["world_size"]
            if not (is_int(step) and 0 <= step <= MAX_STEP and is_int(ws) and ws >= 1):
                raise MarkerError("step must be an integer in [0, 2^63) and world_size one >= 1", path=path)
            files = []
            for f in d["files"]:
                rel = safe_relpath(f["path"], what="file", path=path)
                if not (is_int(f["size"]) and f["size"] >= 0):
                    raise MarkerError(f"file {rel!r} has a bad size", path=path)
                files.append(StagedFile(rel, f["size"]))
            check_file_tree([f.path for f in files], what="file", path=path)
            tensors = d.get("tensors")
            tensors = None if tensors is None else decode_tensors(tensors, TensorInfo, path=path)
            names = list(tensors or ())
            ref = d.get("reference_index")
            if ref is not None and not isinstance(ref, str | dict):
                raise MarkerError("reference_index must be a path or a weight_map", path=path)
            hub, adapter = d.get("hub_plan"), d.get("adapter_plan")
            try:
                hub_plan = None if hub is None else decode_plan(hub, names, path=path)
                adapter_plan = None if adapter is None else decode_plan(adapter, names, path=path)
                ref = ref if not isinstance(ref, dict) else decode_weight_map(ref, names, hub_plan, path=path)
            except HubPlanError as e:
                raise MarkerError(e.message, path=path) from None
            created, metadata = created_and_metadata(d, path=path)
            dtype = d.get("dtype")
            # It reaches `dtype.lower()`: an int there was a raw AttributeError out of the export
            if dtype is not None and not isinstance(dtype, str):
                raise MarkerError(f"dtype must be a dtype's name, not {dtype!r}", path=path)
            node, nodes = d.get("staging_node", 0), d.get("staging_nodes", 1)
            if not (is_int(node) and is_int(nodes) and 0 <= node < nodes <= MAX_STAGING_NODES):
                raise MarkerError(
                    f"bad staging node {node!r} of {nodes!r} (at most {MAX_STAGING_NODES} nodes)", path=path
                )
            return cls(
                step=step,
                world_size=ws,
                files=tuple(files),
                created=created,
                reference_index=ref,
                dtype=dtype,
                metadata=metadata,
                tensors=tensors,
                staging_node=node,
                staging_nodes=nodes,
                hub_plan=hub_plan,
                adapter_plan=adapter_plan,
            )
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
            raise MarkerError(f"malformed marker: {e!r}", path=path) from None


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def created_and_metadata(d: dict[str, Any], *, path: object) -> tuple[float, dict[str, Any]]:
    """A marker's or manifest's `created` (finite seconds) and `metadata` (an object), or a MarkerError:
    `float("nan")` of a string, or `dict()` of a list of pairs with keys of any type, let through what
    the readers then sort and format."""
    created, metadata = d.get("created", 0.0), d.get("metadata")
    if not (is_int(created) or type(created) is float) or not math.isfinite(created):
        raise MarkerError(f"created must be a number of seconds, not {created!r}", path=path)
    if metadata is not None and not isinstance(metadata, dict):
        raise MarkerError("metadata must be a JSON object", path=path)
    return float(created), dict(metadata or {})


def write_marker(step_dir: str | os.PathLike[str], marker: CommitMarker) -> Path:
    """Atomically write the commit marker of `step_dir`. Call only after every file is durable."""
    path = Path(step_dir) / MARKER_NAME
    # One line: indented, every dim of every shape took a line of its own
    write_bytes_atomic(path, (json.dumps(marker.to_json(), separators=(",", ":")) + "\n").encode())
    return path


def read_marker(step_dir: str | os.PathLike[str]) -> CommitMarker:
    """Read and validate the commit marker of `step_dir`."""
    path = Path(step_dir) / MARKER_NAME
    raw = _marker_bytes(path)
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise MarkerError(f"commit marker is not JSON: {e}", path=path) from None
    except RecursionError:
        raise MarkerError("commit marker is not JSON: nested too deep", path=path) from None
    marker = CommitMarker.from_json(data, path=path)
    named = parse_step_dir(Path(step_dir).name)
    if named is not None and named != marker.step:
        raise MarkerError(
            f"the commit marker is for step {marker.step}, but its directory is step {named}",
            path=path,
            hint="a step directory was renamed or copied by hand; give it back the name of its step",
        )
    return marker


def marker_identity(step_dir: str | os.PathLike[str]) -> str:
    """Which save a step directory holds: the sha256 of its marker's bytes.

    The marker names the save's creation time and every file, so a step saved again (a run restarted from
    an earlier checkpoint) has a new identity, while a restored or re-read step keeps its own.
    """
    return identity_of(_marker_bytes(Path(step_dir) / MARKER_NAME))


def _marker_bytes(path: Path) -> bytes:
    try:
        with open_regular(path) as f:  # never more than the limit in memory, never a FIFO's wait
            # read(limit) would allocate the whole limit first, for a marker of any size
            want = min(os.fstat(f.fileno()).st_size, MAX_MARKER_BYTES) + 1
            raw = f.read(want)
            if len(raw) == want:  # it grew since, or it is past the limit: on to the limit
                raw += f.read(MAX_MARKER_BYTES + 1 - len(raw))
    except FileNotFoundError:
        raise MarkerError("no commit marker: the step is not committed", path=path) from None
    except OSError as e:
        raise MarkerError(f"cannot read the commit marker: {e.strerror}", path=path) from None
    if len(raw) > MAX_MARKER_BYTES:
        raise MarkerError("commit marker is larger than 64 MiB", path=path)
    return raw


def identity_of(marker_bytes: bytes) -> str:
    """`marker_identity` of a marker's bytes read from elsewhere (a copy on a store)."""
    return "sha256:" + hashlib.sha256(marker_bytes).hexdigest()


def check_staged_files(step_dir: str | os.PathLike[str], marker: CommitMarker) -> None:
    """Every file the marker lists exists inside the step directory, as a regular file of the listed size.

    A symlink that resolves outside the step directory is refused: staged data is trusted only where the
    trainer wrote it.
    """
    root = Path(step_dir).resolve()
    for f in marker.files:
        p = Path(step_dir) / f.path
        try:
            real = p.resolve(strict=True)
        except FileNotFoundError:
            raise ShardError(
                f"listed in the commit marker but missing ({f.size} bytes expected)", path=p
            ) from None
        if not real.is_relative_to(root):
            raise MarkerError(f"resolves outside the step directory, to {real}", path=p)
        st = real.stat()
        if not os.path.isfile(real):
            raise ShardError("is not a regular file", path=p)
        if st.st_size != f.size:
            raise ShardError(f"is {st.st_size} bytes, the commit marker lists {f.size} (truncated?)", path=p)
