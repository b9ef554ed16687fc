"""Where an export's shards come from: a committed step directory (its marker read and every listed file
checked) or a bare DCP shard directory; and what the source says about them (the tensors' global shapes,
its to-Hub plan, its dtype hint, its reference index, its extras). `engine/adopt/source.py` is the same
seam for a trainer's own checkpoint.

`held_source` reads a step the export holds open (`contract/step/held.py`) through handles: its `model/`
and `extras/` held from the step's descriptor, each shard and extra opened from theirs, none through a
link, and read again by its `/proc/self/fd/N` path. A `model/` (or a file in it) swapped for a link to
another save of the same shapes after the check would pass every check by size, header and plan; read by
name, its bytes would be exported and published as this step's. Shards beyond the descriptors the process
may hold are closed once their header is read and opened again only from the held `model/`, as the same
files (`contract/step/reopen.py`): a step of more ranks than the hard open-files limit is exported."""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from stagerd.contract import commit_marker, layout
from stagerd.contract.dtypes import parse_export_dtype
from stagerd.contract.hub_plan import HubPlan
from stagerd.contract.reference_index import load_weight_map, read_reference_index
from stagerd.contract.safetensors_format import Header, read_header
from stagerd.contract.step.held import HeldDir, HeldFiles, reading
from stagerd.engine.shard_scan import scan_shards, shard_paths
from stagerd.errors import ExtrasError, ReferenceIndexError, ShardError, open_failed

WHY = "a step's inputs are read only from the directories and files the trainer wrote, never through a link"
HINT = "replace the link by the directory or file it stands for (its target was left as it is), then retry"


@dataclass(frozen=True)
class Source:
    """Where shards come from: a step directory (with its marker) or a bare DCP shard directory."""

    model_dir: Path
    marker: commit_marker.CommitMarker | None
    step_dir: Path | None

    @property
    def listed(self) -> list[str] | None:
        if self.marker is None:
            return None
        prefix = layout.MODEL_DIR + "/"
        return [f.path[len(prefix) :] for f in self.marker.files if f.path.startswith(prefix)]

    def extras(self) -> list[str]:
        """Extras (config, tokenizer, README) relative to `extras/`."""
        if self.step_dir is None:
            return []
        prefix = layout.EXTRAS_DIR + "/"
        if self.marker is not None:
            return [f.path[len(prefix) :] for f in self.marker.files if f.path.startswith(prefix)]
        root = self.step_dir / layout.EXTRAS_DIR
        return (
            sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.is_dir() else []
        )

    def extra_path(self, rel: str) -> Path:
        """The file an extra (relative to the export) is copied from."""
        return self.step_dir / layout.EXTRAS_DIR / rel  # type: ignore[operator]

    def extra_name(self, rel: str) -> Path:
        """The path that names an extra in messages."""
        return self.extra_path(rel)

    def scan(self) -> Iterable[Header]:
        """The source's validated shard headers, read one at a time as they are taken."""
        return scan_shards(self.model_dir, self.listed)

    def expected(self) -> Mapping[str, commit_marker.TensorInfo] | None:
        """The global dtype and shape of every tensor, as the trainer saved them, where known."""
        return self.marker.tensors if self.marker else None

    def views(self) -> HubPlan | None:
        """The source's own to-Hub plan."""
        return self.marker.hub_plan if self.marker else None

    def target_dtype(self, override: str | None) -> str | None:
        """The export dtype: an explicit `override` wins, else the marker's hint, else keep (None)."""
        hint = override if override is not None else (self.marker.dtype if self.marker else None)
        return parse_export_dtype(hint)

    def reference(self) -> dict[str, str] | None:
        ref = self.marker.reference_index if self.marker is not None else None
        if ref is None:
            return None
        if isinstance(ref, Mapping):
            return load_weight_map(ref, path=self.step_dir)
        # A path only inside the step, a regular file (read_reference_index refuses the rest, and caps
        # the size): the Stager records the weight_map itself, older markers a path.
        step_dir = self.step_dir or Path()
        path = (step_dir / ref).resolve()
        if not path.is_relative_to(step_dir.resolve()):
            raise ReferenceIndexError(
                f"the commit marker names a reference index outside the step: {ref}",
                path=step_dir / layout.MARKER_NAME,
                hint="save the step again with this stagerd: the Stager now records the weight_map itself",
            )
        return read_reference_index(path)


def open_source(src: Path) -> Source:
    """A step directory (committed: its marker is read and every listed file checked) or a shard directory."""
    src = Path(src)
    if (src / layout.MARKER_NAME).exists():
        marker = commit_marker.read_marker(src)
        commit_marker.check_staged_files(src, marker)
        if not any(f.path.startswith(layout.MODEL_DIR + "/") for f in marker.files):
            raise ShardError("the commit marker lists no model/ shards", path=src / layout.MARKER_NAME)
        return Source(src / layout.MODEL_DIR, marker, src)
    if (src / layout.MODEL_DIR).is_dir():
        return Source(src / layout.MODEL_DIR, None, src)
    return Source(src, None, None)


@dataclass(frozen=True)
class HeldSource(Source):
    """A committed step read through handles (see the module): `model_dir` and `step_dir` are proc paths."""

    model: HeldDir
    extras_dir: HeldDir | None
    files: HeldFiles

    def scan(self) -> Iterable[Header]:
        # Names checked in the held model/; each header read from the file opened then, which the plan's
        # copies open again by the same proc path.
        return (self._header(p.name) for p in shard_paths(self.model_dir, self.listed))

    def _header(self, name: str) -> Header:
        try:
            path = self.files.open(self.model, name, why=WHY, hint=HINT, bounded=True)
            with reading(path) as now:  # a shard closed for want of descriptors: opened again, the same
                header = read_header(now)
        except OSError as e:
            raise open_failed(e, self.model.path / name, ShardError) from None
        return header if now == path else replace(header, path=str(path))

    def extra_path(self, rel: str) -> Path:
        if self.extras_dir is None:
            raise ExtrasError("is missing", path=self.extra_name(rel))
        try:
            return self.files.open_at(self.extras_dir, rel, why=WHY, hint=HINT)
        except OSError as e:
            if e.errno == errno.ENOENT:
                raise ExtrasError("is missing", path=self.extra_name(rel)) from None
            raise open_failed(e, self.extra_name(rel), ExtrasError) from None

    def extra_name(self, rel: str) -> Path:
        return self.model.path.parent / layout.EXTRAS_DIR / rel


@contextlib.contextmanager
def held_source(step: HeldDir) -> Iterator[Source]:
    """The source of the step directory `step` holds (see the module); a step without a marker (which the
    export refuses) as `open_source` gives it. Errors name the real paths."""
    source = open_source(step.proc)
    if source.marker is None:
        yield source
        return
    extras = any(f.path.startswith(layout.EXTRAS_DIR + "/") for f in source.marker.files)
    with HeldFiles() as files, files.naming():
        model = files.hold(step, layout.MODEL_DIR, why=WHY, hint=HINT)
        extras_dir = files.hold(step, layout.EXTRAS_DIR, why=WHY, hint=HINT) if extras else None
        marker = source.marker
        yield HeldSource(model.proc, marker, step.proc, model=model, extras_dir=extras_dir, files=files)
