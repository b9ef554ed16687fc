"""A raw step as `restore` finds it on the sink: one manifest, or for a node-locally staged step one part per
staging node (`PREFIX/raw/step-N/node-K-of-M/`), which must all be there and are merged into one whole
step under one marker listing every node's files before it lands in ROOT."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stagerd.contract.manifest import ExportManifest
    from stagerd.sinks.fetch import RemoteStore


def raw_parts(store: RemoteStore, prefix: str, step: int) -> list[tuple[str, ExportManifest]]:
    """The raw step's manifest; or, for a node-locally staged step, every node's (all must be there)."""
    from stagerd.contract import layout
    from stagerd.errors import RestoreError
    from stagerd.sinks.fetch import node_parts, read_manifest

    if store.read(f"{prefix}/{layout.MANIFEST_NAME}") is not None:
        return [(prefix, read_manifest(store, prefix, step))]
    names, whole = node_parts(store.sizes(prefix))
    if not names:
        return [(prefix, read_manifest(store, prefix, step))]  # the RestoreError naming the manifest
    if not whole:
        have = ", ".join(names)
        raise RestoreError(f"holds node parts {have}: not every staging node's", path=store.where(prefix))
    return [(f"{prefix}/{name}", read_manifest(store, f"{prefix}/{name}", step)) for name in names]


def merge_nodes(tmp: Path, node_dirs: list[Path], where: str) -> None:
    """Node-local staging: every node's files into one whole step, under one marker listing them all."""
    import dataclasses

    from stagerd.contract import commit_marker, layout
    from stagerd.errors import MarkerError, RestoreError, ShardError

    # The markers came from the sink (their sha256 is only the manifest's word): each is read strictly and
    # must describe its node's files before one file moves, and together they must fit in one directory.
    try:
        markers = [commit_marker.read_marker(d) for d in node_dirs]
        for d, m in zip(node_dirs, markers, strict=True):
            commit_marker.check_staged_files(d, m)
        layout.check_file_tree([f.path for m in markers for f in m.files], what="file", path=where)
    except (MarkerError, ShardError) as e:
        local = Path(str(e.path))  # named as it is on the sink: the temp copy is gone once this raises
        at = f"{where}/{local.relative_to(tmp).as_posix()}" if local.is_relative_to(tmp) else where
        raise RestoreError(f"a staging node's part: {e.message}", path=at) from None
    first = markers[0]
    if any(
        (m.step, m.world_size, m.staging_nodes) != (first.step, first.world_size, len(markers))
        for m in markers
    ):
        raise RestoreError(
            "the staging nodes' markers disagree on the step, world size or node count", path=where
        )
    files: dict[str, commit_marker.StagedFile] = {}
    for d, m in zip(node_dirs, markers, strict=True):
        for f in m.files:
            files[f.path] = f
            dst = tmp / f.path
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.rename(d / f.path, dst)
        shutil.rmtree(d)
    whole = dataclasses.replace(
        first,
        files=tuple(sorted(files.values(), key=lambda f: f.path)),
        staging_node=0,
        staging_nodes=1,
        metadata=next((m.metadata for m in markers if m.metadata), first.metadata),
    )
    for d in sorted({(tmp / f).parent for f in files}, key=lambda p: -len(p.parts)):
        layout.fsync_dir(d)
    commit_marker.write_marker(tmp, whole)
