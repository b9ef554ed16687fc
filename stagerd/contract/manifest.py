"""`stagerd.manifest.json`: what one published step holds; a sink writes it last, so its presence commits."""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from stagerd.contract.commit_marker import created_and_metadata, is_int
from stagerd.contract.layout import MANIFEST_FORMAT, MAX_STEP, check_file_tree, safe_relpath
from stagerd.errors import MarkerError

_SHA256_RE = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class ManifestFile:
    """One published file: path relative to the export, size, sha256 hex digest."""

    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class ExportManifest:
    """`stagerd.manifest.json`: what one published step holds. Written last; its presence is the commit."""

    step: int
    files: tuple[ManifestFile, ...]
    created: float = field(default_factory=time.time)
    metadata: dict[str, Any] = field(default_factory=dict)
    format: str = MANIFEST_FORMAT

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["files"] = [asdict(f) for f in self.files]
        return {"format": d.pop("format"), **d}

    @classmethod
    def from_json(cls, d: Mapping[str, Any], *, path: object = None) -> ExportManifest:
        try:
            if d.get("format") != MANIFEST_FORMAT:
                raise MarkerError(f"not a {MANIFEST_FORMAT} manifest", path=path)
            files = tuple(
                ManifestFile(safe_relpath(f["path"], what="file", path=path), f["size"], f["sha256"])
                for f in d["files"]
            )
            step = d["step"]
            if not (is_int(step) and 0 <= step <= MAX_STEP):
                raise MarkerError(f"step {step!r} is not an integer in [0, 2^63)", path=path)
            for f in files:
                if not (is_int(f.size) and f.size >= 0 and isinstance(f.sha256, str)):
                    raise MarkerError(
                        f"file {f.path!r}: its size and sha256 are a {type(f.size).__name__} and a "
                        f"{type(f.sha256).__name__}, not a non-negative integer and a string",
                        path=path,
                    )
                if not _SHA256_RE.fullmatch(f.sha256):
                    raise MarkerError(
                        f"file {f.path!r}: sha256 {f.sha256[:80]!r} is not 64 hex digits", path=path
                    )
            check_file_tree([f.path for f in files], what="file", path=path)
            created, metadata = created_and_metadata(dict(d), path=path)
            return cls(step=step, files=files, created=created, metadata=metadata)
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
            raise MarkerError(f"malformed manifest: {e!r}", path=path) from None
