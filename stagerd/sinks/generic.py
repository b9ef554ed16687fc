"""The backend for any other fsspec filesystem (gs://, az://, memory://...)."""

from __future__ import annotations

import builtins
import hashlib
from typing import Any

from stagerd.sinks.hashing import hash_file, iter_file
from stagerd.sinks.listed import skipped, under
from stagerd.sinks.objects import ByteProgress, LocalFile, RemoteObject, Uploaded, changed_error


class FsspecBackend:
    """Any fsspec filesystem (gs://, az://, memory://...): sequential streamed writes, sizes-only verify.

    The manifest is created with an `exists` check then a write: such stores offer no portable
    create-if-absent, so two publishers racing on one step could both write it (stagerd runs one per node).
    """

    has_checksums = False

    def __init__(self, fs: Any, root: str) -> None:
        self.fs, self.root = fs, root.rstrip("/")

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def list(self, prefix: str) -> dict[str, RemoteObject]:
        base = self._path(prefix)
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        out: dict[str, RemoteObject] = {}
        outside: builtins.list[str] = []
        strip = self.fs._strip_protocol(base).rstrip("/") + "/"
        for name, info in found.items():
            rel = under(strip, self.fs._strip_protocol(name), outside)
            if rel is not None and info.get("type", "file") == "file":
                out[rel] = RemoteObject(int(info["size"]))
        skipped(base, outside)
        return out

    def checksums(self, prefix: str, rels: builtins.list[str]) -> dict[str, str | None]:
        return dict.fromkeys(rels)

    def sweep(self, prefix: str, *, settled: bool = False) -> None:
        """Nothing: writes through fsspec leave no temp names of ours."""

    def read(self, key: str, limit: int | None = None) -> bytes | None:
        try:
            return self.fs.cat_file(self._path(key), start=None if limit is None else 0, end=limit)
        except FileNotFoundError:
            return None

    def write(self, key: str, data: bytes) -> None:
        self.fs.pipe_file(self._path(key), data)

    def create(self, key: str, data: bytes) -> bool:
        if self.fs.exists(self._path(key)):
            return False
        self.fs.pipe_file(self._path(key), data)
        return True

    def digest(self, f: LocalFile) -> Uploaded:
        d = hash_file(f.path)
        return Uploaded(f.rel, d.size, d.sha256, None)

    def upload(
        self, prefix: str, files: builtins.list[LocalFile], progress: ByteProgress
    ) -> builtins.list[Uploaded]:
        out = []
        for f in files:
            h = hashlib.sha256()
            size = 0
            path = self._path(f"{prefix}/{f.rel}")
            self.fs.makedirs(self.fs._parent(path), exist_ok=True)
            with self.fs.open(path, "wb") as dst:
                for view in iter_file(f.path):
                    h.update(view)
                    dst.write(bytes(view))
                    size += len(view)
                    progress(len(view))
            if size != f.size:
                raise changed_error(f, size)
            out.append(Uploaded(f.rel, size, h.hexdigest(), None))
        return out

    def close(self) -> None:
        pass
