"""`stagerd.manifest.json`: what one published step holds; a sink writes it last, so its presence commits."""

from __future__ import annotations

import json
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


# What is read of a step's manifest: anyone may put an object of any size at its key, and a publish read
# it whole (a FIFO on file:// held it for good)
MAX_MANIFEST_BYTES = 64 << 20


def read_manifest(data: bytes, path: object) -> ExportManifest:
    """A manifest from its bytes, whatever was handed over (a sink's object, a file `stagerd verify` is
    given): a `MarkerError` whose message says what the bytes are ("is larger than 64 MiB", "is not valid
    JSON (...)", "is malformed: ..."), for the caller to name them in its own error."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise MarkerError(f"is larger than {MAX_MANIFEST_BYTES >> 20} MiB", path=path)
    try:
        return ExportManifest.from_json(json.loads(data), path=path)
    except RecursionError:
        raise MarkerError("is not valid JSON (nested too deep)", path=path) from None
    except (ValueError, UnicodeDecodeError, AttributeError) as e:
        raise MarkerError(f"is not valid JSON ({e})", path=path) from None
    except MarkerError as e:
        raise MarkerError(f"is malformed: {e.message}", path=path) from None
