"""The LFS half of the Hub test server: preupload, the LFS batch API, basic and multipart uploads, verify.

A mixin of `HubApp`, which supplies the store, the stats and the repo lookup."""

from __future__ import annotations

import base64
import hashlib
import os
import secrets
import threading
from dataclasses import dataclass, field
from math import ceil
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pathspec
from werkzeug.wrappers import Request, Response

from tests.hubserver.store import Blob
from tests.hubserver.wire import _HEX64, _LFS_SUFFIXES, _REGULAR_MAX, HubFail, _json


@dataclass
class _Upload:
    repo_id: str
    oid: str
    size: int
    chunk_size: int | None
    parts: dict[int, tuple[Path, str]] = field(default_factory=dict)


def _ignore_rules(sent: Any, hosted: Blob | None) -> pathspec.GitIgnoreSpec | None:
    """The rules the Hub answers `shouldIgnore` by: the `.gitignore` the request sends (`gitIgnore`, which
    huggingface_hub sends where the commit adds one), else the repo's own root `.gitignore` at the revision
    (only the root one counts, as on the Hub), read as git reads it; None where there is neither."""
    if isinstance(sent, str):
        text = sent
    elif hosted is not None and hosted.content is not None:
        text = hosted.content.decode("utf-8", "replace")
    else:
        return None
    return pathspec.GitIgnoreSpec.from_lines(text.splitlines())


class LfsEndpoints:
    """`h_preupload`, `h_lfs_*`: the endpoints huggingface_hub's `lfs.py` and `_commit_api.py` call."""

    def h_preupload(self, request: Request, org: str, name: str, rev: str, **_: Any) -> Response:
        repo, _user = self._repo(request, org, name, write=True)
        commit = self._rev(repo, rev)
        body = self._body(request)
        ignored = _ignore_rules(body.get("gitIgnore"), commit.tree.get(".gitignore"))
        out = []
        for f in body.get("files", []):
            sample = base64.b64decode(f.get("sample", ""))
            lfs = f["path"].endswith(_LFS_SUFFIXES) or int(f["size"]) > _REGULAR_MAX or b"\0" in sample
            remote = commit.tree.get(f["path"])
            oid = None if remote is None else (remote.sha256 if remote.is_lfs else remote.git_oid)
            out.append(
                {
                    "path": f["path"],
                    "uploadMode": "lfs" if lfs else "regular",
                    "shouldIgnore": ignored is not None and ignored.match_file(f["path"]),
                    "oid": oid,
                }
            )
        return _json({"files": out, "commitOid": commit.oid})

    def h_lfs_batch(self, request: Request, org: str, repo_git: str, **_: Any) -> Response:
        if not repo_git.endswith(".git"):
            raise HubFail(404, "Not found")
        repo, _user = self._repo(request, org, repo_git.removesuffix(".git"), write=True)
        body = self._body(request)
        if body.get("operation") != "upload":
            raise HubFail(400, "only the upload operation is supported")
        base = request.host_url.rstrip("/")
        objects, multipart = [], False
        for obj in body.get("objects", []):
            oid, size = obj.get("oid"), obj.get("size")
            if not (isinstance(oid, str) and _HEX64.match(oid) and isinstance(size, int) and size >= 0):
                objects.append(
                    {"oid": str(oid), "size": int(size or 0), "error": {"code": 422, "message": "bad oid"}}
                )
                continue
            with self.store.lock:
                held = repo.lfs.get(oid)
            if held is not None:
                if held != size:
                    objects.append(
                        {"oid": oid, "size": size, "error": {"code": 422, "message": "size mismatch"}}
                    )
                else:
                    objects.append({"oid": oid, "size": size, "authenticated": True})
                continue
            ticket = secrets.token_urlsafe(16)
            verify = {"href": f"{base}/_lfs/verify/{quote(repo.repo_id, safe='/')}", "header": {}}
            if size > self.config.multipart_threshold and "multipart" in body.get("transfers", ["basic"]):
                multipart = True
                chunk = self.config.multipart_chunk_size
                self._uploads[ticket] = _Upload(repo.repo_id, oid, size, chunk)
                header = {"chunk_size": str(chunk)}
                header.update(
                    {str(i): f"{base}/_lfs/part/{ticket}/{i}" for i in range(1, ceil(size / chunk) + 1)}
                )
                upload = {"href": f"{base}/_lfs/complete/{ticket}", "header": header}
            else:
                self._uploads[ticket] = _Upload(repo.repo_id, oid, size, None)
                upload = {"href": f"{base}/_lfs/put/{ticket}"}
            objects.append(
                {
                    "oid": oid,
                    "size": size,
                    "authenticated": True,
                    "actions": {"upload": upload, "verify": verify},
                }
            )
        return _json(
            {"transfer": "multipart" if multipart else "basic", "objects": objects, "hash_algo": "sha256"},
            headers={"Content-Type": "application/vnd.git-lfs+json"},
        )

    def _copy_body(self, request: Request, f: Any, h: Any) -> int:
        """Stream an LFS request body into the open file `f`, hashing it with `h`; returns its size."""
        n, hook = 0, self.lfs_hook
        try:
            while chunk := request.stream.read(1 << 20):
                h.update(chunk)
                f.write(chunk)
                n += len(chunk)
                if hook is not None:
                    hook.progress(n - len(chunk), n)
        finally:
            with self.stats.lock:
                self.stats.bytes_received += n
        return n

    def _receive(self, request: Request, dest: Path) -> tuple[int, str]:
        """Stream the request body into `dest`, returning (size, sha256); a cut-off body leaves no file."""
        h = hashlib.sha256()
        try:
            with open(dest, "wb") as f:
                n = self._copy_body(request, f, h)
        except BaseException:
            dest.unlink(missing_ok=True)
            raise
        return n, h.hexdigest()

    def _store_object(self, up: _Upload, tmp: Path, size: int, sha: str) -> None:
        if size != up.size or sha != up.oid:
            tmp.unlink(missing_ok=True)
            raise HubFail(
                400, f"uploaded content does not match oid {up.oid} / size {up.size} (got {sha} / {size})"
            )
        os.replace(tmp, self.store.lfs_path(up.oid))
        with self.store.lock:
            self.store.repos[up.repo_id].lfs[up.oid] = up.size
        with self.stats.lock:
            self.stats.lfs_uploads[up.oid] += 1

    def _ticket(self, ticket: str) -> _Upload:
        up = self._uploads.get(ticket)
        if up is None:
            raise HubFail(403, "unknown or expired upload URL")
        return up

    def h_lfs_put(self, request: Request, ticket: str, **_: Any) -> Response:
        up = self._ticket(ticket)
        tmp = self._tmp / f"{ticket}.{threading.get_ident()}"
        size, sha = self._receive(request, tmp)
        self._store_object(up, tmp, size, sha)
        return Response(status=200)

    def h_lfs_part(self, request: Request, ticket: str, part: int, **_: Any) -> Response:
        up = self._ticket(ticket)
        if up.chunk_size is None or not 1 <= part <= ceil(up.size / up.chunk_size):
            raise HubFail(400, f"bad part number {part}")
        # Parts land at their offset in one file, in any order, like an S3 multipart upload.
        whole = self._tmp / f"{ticket}.whole"
        with self.store.lock:
            if not whole.exists():
                whole.touch()
        h = hashlib.md5(usedforsecurity=False)
        with open(whole, "r+b") as f:
            f.seek((part - 1) * up.chunk_size)
            n = self._copy_body(request, f, h)
        expected = min(up.chunk_size, up.size - (part - 1) * up.chunk_size)
        if n != expected:
            raise HubFail(400, f"part {part} is {n} bytes, expected {expected}")
        etag = f'"{h.hexdigest()}"'
        up.parts[part] = (whole, etag)
        return Response(status=200, headers={"ETag": etag})

    def h_lfs_complete(self, request: Request, ticket: str, **_: Any) -> Response:
        up = self._ticket(ticket)
        body = self._body(request)
        parts = body.get("parts", [])
        n = ceil(up.size / (up.chunk_size or 1))
        if body.get("oid") != up.oid or [p.get("partNumber") for p in parts] != list(range(1, n + 1)):
            raise HubFail(400, f"completion must list parts 1..{n} of {up.oid}")
        for p in parts:
            held = up.parts.get(p["partNumber"])
            if held is None or held[1] != p.get("etag"):
                raise HubFail(400, f"part {p['partNumber']} missing or etag mismatch")
        whole = self._tmp / f"{ticket}.whole"
        h, size = hashlib.sha256(), 0
        with open(whole, "rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
                size += len(chunk)
        self._store_object(up, whole, size, h.hexdigest())
        return _json({})

    def h_lfs_verify(self, request: Request, org: str, name: str, **_: Any) -> Response:
        repo, _user = self._repo(request, org, name, write=True)
        body = self._body(request)
        with self.store.lock:
            held = repo.lfs.get(body.get("oid"))
        if held is None or held != body.get("size"):
            raise HubFail(404, f"object {body.get('oid')} of size {body.get('size')} not found")
        return _json({})
