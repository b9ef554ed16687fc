"""The WSGI application: the subset of the Hugging Face Hub HTTP API that huggingface_hub 2.4 uses.

Test infrastructure only. Requests and response fields follow the installed client
(`hf_api.py`, `_commit_api.py`, `lfs.py`, `file_download.py`, `utils/_pagination.py`):

- `POST /api/repos/create`, `GET /api/models/{repo}[/revision/{rev}]`, `GET /api/whoami-v2`
- `POST /api/validate-yaml` (create_commit checks a README.md's front matter with it)
- `POST /api/models/{repo}/preupload/{rev}` -> upload mode (lfs/regular) and the remote oid per file
- `POST /{repo}.git/info/lfs/objects/batch` -> basic (one PUT) or multipart (PUT per part, then POST
  completion) actions plus verify; objects the repo already holds get no actions (no re-upload)
- `POST /api/models/{repo}/commit/{rev}`: ndjson header (`summary`, `description`, `parentCommit`) then
  `file`, `lfsFile`, `deletedFile`, `deletedFolder` lines; a stale `parentCommit` is a 412
- `GET .../refs`, `GET .../commits/{rev}` (`limit` per page, `p` the page number, `Link` to the next)
  and `GET .../tree/{rev}[/{path}]` (paginated by `Link`),
  `POST|DELETE .../tag/{rev}`, `POST|DELETE .../branch/{name}`
- `GET|HEAD /{repo}/resolve/{rev}/{path}` with `X-Repo-Commit`, `ETag` and `Range`

Routing matches the raw (still percent-encoded) path, so a revision like `a%2Fb` stays one segment.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import re
import secrets
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from math import ceil
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlencode

import yaml
from werkzeug.exceptions import HTTPException
from werkzeug.routing import Map, Rule
from werkzeug.utils import send_file
from werkzeug.wrappers import Request, Response

from tests.hubserver.faults import Fault, FaultPlan
from tests.hubserver.store import Blob, HubStore, Repo, folder_oid, hub_date, list_tree

_HEX40 = re.compile(r"^[0-9a-f]{40}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx")
_REGULAR_MAX = 10 * 1024 * 1024  # the Hub stores larger files in LFS whatever their name

_URLS = Map(
    [
        Rule("/api/whoami-v2", endpoint="whoami", methods=["GET"]),
        Rule("/api/validate-yaml", endpoint="validate_yaml", methods=["POST"]),
        Rule("/api/repos/create", endpoint="create_repo", methods=["POST"]),
        Rule("/api/models/<org>/<name>", endpoint="repo_info", methods=["GET"]),
        Rule("/api/models/<org>/<name>/revision/<rev>", endpoint="repo_info", methods=["GET"]),
        Rule("/api/models/<org>/<name>/preupload/<rev>", endpoint="preupload", methods=["POST"]),
        Rule("/api/models/<org>/<name>/commit/<rev>", endpoint="commit", methods=["POST"]),
        Rule("/api/models/<org>/<name>/refs", endpoint="refs", methods=["GET"]),
        Rule("/api/models/<org>/<name>/commits/<rev>", endpoint="commits", methods=["GET"]),
        Rule("/api/models/<org>/<name>/tree/<rev>", endpoint="tree", methods=["GET"]),
        Rule("/api/models/<org>/<name>/tree/<rev>/<path:sub>", endpoint="tree", methods=["GET"]),
        Rule("/api/models/<org>/<name>/tag/<rev>", endpoint="tag", methods=["POST", "DELETE"]),
        Rule("/api/models/<org>/<name>/branch/<rev>", endpoint="branch", methods=["POST", "DELETE"]),
        Rule("/<org>/<repo_git>/info/lfs/objects/batch", endpoint="lfs_batch", methods=["POST"]),
        Rule("/<org>/<name>/resolve/<rev>/<path:file>", endpoint="resolve", methods=["GET"]),
        Rule("/_lfs/put/<ticket>", endpoint="lfs_put", methods=["PUT"]),
        Rule("/_lfs/part/<ticket>/<int:part>", endpoint="lfs_part", methods=["PUT"]),
        Rule("/_lfs/complete/<ticket>", endpoint="lfs_complete", methods=["POST"]),
        Rule("/_lfs/verify/<org>/<name>", endpoint="lfs_verify", methods=["POST"]),
    ]
)


class HubFail(Exception):
    """An API error answered as JSON, with the Hub's X-Error-Code / X-Error-Message headers."""

    def __init__(
        self, status: int, message: str, code: str | None = None, headers: dict | None = None, **extra: Any
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
        self.headers = dict(headers or {})
        self.extra = extra


@dataclass
class HubConfig:
    """Tunables of one server. Small values exercise multipart and pagination in tests."""

    multipart_threshold: int = 64 * 1024 * 1024
    multipart_chunk_size: int = 16 * 1024 * 1024
    tree_page_size: int = 1000
    commits_page_size: int = 50  # commits per page when the request names no `limit`
    commits_page_max: int = 1000  # the largest `limit` honoured


@dataclass
class RequestLog:
    method: str
    path: str
    status: int
    at: float
    authorization: bool


@dataclass
class HubStats:
    """What the server saw, for assertions: every request, LFS uploads per oid, commits per repo."""

    requests: list[RequestLog] = field(default_factory=list)
    lfs_uploads: Counter = field(default_factory=Counter)  # sha256 -> completed uploads
    bytes_received: int = 0
    commits: Counter = field(default_factory=Counter)  # repo_id -> commits made through the API
    commits_served: int = 0  # commit entries sent by the history endpoint
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, method: str, pattern: str, status: int | None = None) -> int:
        """How many requests matched `method` and the path regex `pattern` (and `status`, if given)."""
        with self.lock:
            return sum(
                1
                for r in self.requests
                if r.method == method
                and re.search(pattern, r.path)
                and (status is None or r.status == status)
            )

    def times(self, method: str, pattern: str) -> list[float]:
        with self.lock:
            return [r.at for r in self.requests if r.method == method and re.search(pattern, r.path)]


@dataclass
class LfsBodyHook:
    """Calls `fn()` once, from the server thread, when the `nth` LFS upload request (a basic PUT or one
    multipart part) to receive `after` bytes of its body has received them: mid-upload, by design."""

    after: int
    fn: Callable[[], None]
    nth: int = 1
    crossed: int = 0
    fired: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def progress(self, before: int, now: int) -> None:
        """One request's body went from `before` to `now` bytes."""
        if not before < self.after <= now:
            return
        with self.lock:
            self.crossed += 1
            fire = self.crossed == self.nth
            self.fired = self.fired or fire
        if fire:
            self.fn()


@dataclass
class _Upload:
    repo_id: str
    oid: str
    size: int
    chunk_size: int | None
    parts: dict[int, tuple[Path, str]] = field(default_factory=dict)


class HubApp:
    """WSGI callable. Tokens map to (user, role) with role `write` or `read`."""

    def __init__(
        self, store: HubStore, faults: FaultPlan, tokens: dict[str, tuple[str, str]], config: HubConfig
    ) -> None:
        self.store, self.faults, self.tokens, self.config = store, faults, tokens, config
        self.stats = HubStats()
        self.lfs_hook: LfsBodyHook | None = None
        self._uploads: dict[str, _Upload] = {}
        self._tmp = store.lfs_dir / ".incoming"
        self._tmp.mkdir(exist_ok=True)

    # --- plumbing -----------------------------------------------------------------------------------

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        request = Request(environ)
        raw = (environ.get("RAW_URI") or environ.get("REQUEST_URI") or request.path).split("?", 1)[0]
        fault = self.faults.take(request.method, unquote(raw))
        status = 0
        try:
            if fault is not None and fault.hang:
                self._hang(request, environ)
            if fault is not None and fault.stall_after is not None:
                response = self._dispatch(request, raw)
                status = response.status_code
                return self._stall(response, fault.stall_after, environ, start_response)
            if fault is not None and not fault.drop_response:
                response = self._fault(fault, environ)
            else:
                response = self._dispatch(request, raw)
                if fault is not None:
                    _drop_connection(environ)
            status = response.status_code
            return response(environ, start_response)
        finally:
            with self.stats.lock:
                self.stats.requests.append(
                    RequestLog(
                        request.method,
                        unquote(raw),
                        status,
                        time.monotonic(),
                        "authorization" in request.headers,
                    )
                )

    def _hang(self, request: Request, environ: dict) -> None:
        """Read the whole request, answer nothing until released, then drop the connection."""
        hold = self.faults.hold()
        request.get_data()
        hold.wait()
        _drop_connection(environ)

    def _stall(
        self, response: Response, after: int, environ: dict, start_response: Callable
    ) -> Iterable[bytes]:
        """Send the status, the headers and at most `after` bytes of the body (never all of it), then hold
        the connection until released and drop it."""
        hold = self.faults.hold()
        body = response.get_data()
        headers = [(k, v) for k, v in response.headers.items() if k.lower() != "content-length"]
        start_response(response.status, [*headers, ("Content-Length", str(len(body)))])

        def chunks() -> Iterable[bytes]:
            yield body[: max(0, min(after, len(body) - 1))]
            hold.wait()
            _drop_connection(environ)

        return chunks()

    def _fault(self, fault: Fault, environ: dict) -> Response:
        if fault.drop:
            stream = environ["wsgi.input"]
            left = min(fault.drop_after, int(environ.get("CONTENT_LENGTH") or 0))
            while left > 0 and (chunk := stream.read(min(left, 1 << 16))):
                left -= len(chunk)
            _drop_connection(environ)
        return Response(fault.body, status=fault.status, headers=fault.headers, mimetype="application/json")

    def _dispatch(self, request: Request, raw_path: str) -> Response:
        try:
            endpoint, args = _URLS.bind_to_environ(request.environ).match(raw_path, method=request.method)
            args = {k: unquote(v) if isinstance(v, str) else v for k, v in args.items()}
            return getattr(self, f"h_{endpoint}")(request, raw_path=raw_path, **args)
        except HubFail as e:
            headers = {"X-Error-Message": e.message, **e.headers}
            if e.code:
                headers["X-Error-Code"] = e.code
            return _json({"error": e.message, **e.extra}, e.status, headers)
        except HTTPException as e:
            return _json({"error": e.description or e.name}, e.code or 500)

    def _auth(self, request: Request) -> tuple[str | None, str | None]:
        header = request.headers.get("Authorization")
        if header is None:
            return None, None
        token = header.removeprefix("Bearer ").strip()
        if token not in self.tokens:
            raise HubFail(401, "Invalid credentials in Authorization header")
        return self.tokens[token]

    def _user(self, request: Request, *, write: bool) -> str:
        user, role = self._auth(request)
        if user is None:
            raise HubFail(401, "You must be authenticated to access this resource")
        if write and role != "write":
            raise HubFail(403, f"Forbidden: the token of {user!r} has no write permission")
        return user

    def _repo(self, request: Request, org: str, name: str, *, write: bool = False) -> tuple[Repo, str | None]:
        user, role = self._auth(request)
        repo = self.store.repos.get(f"{org}/{name}")
        if repo is None or (repo.private and user is None):
            raise HubFail(404, "Repository not found", "RepoNotFound")
        if write:
            if user is None:
                raise HubFail(401, "You must be authenticated to write to this repository")
            if role != "write":
                raise HubFail(
                    403, f"Forbidden: the token of {user!r} has no write permission on {org}/{name}"
                )
        return repo, user

    @staticmethod
    def _rev(repo: Repo, rev: str):
        commit = repo.resolve(rev)
        if commit is None:
            raise HubFail(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        return commit

    @staticmethod
    def _body(request: Request) -> Any:
        try:
            return json.loads(request.get_data() or b"{}")
        except ValueError as e:
            raise HubFail(400, f"request body is not JSON: {e}") from None

    def _page(self, request: Request, raw_path: str, items: list, size: int, key: str) -> Response:
        start = int(request.args.get(key, 0))
        page = items[start : start + size]
        headers = {}
        if start + size < len(items):
            params = {k: v for k, v in request.args.items() if k != key}
            params[key] = str(start + size)
            headers["Link"] = f'<{request.host_url.rstrip("/")}{raw_path}?{urlencode(params)}>; rel="next"'
        return _json(page, 200, headers)

    # --- repos --------------------------------------------------------------------------------------

    def h_whoami(self, request: Request, **_: Any) -> Response:
        user, role = self._auth(request)
        if user is None:
            raise HubFail(401, "You must be authenticated")
        return _json({"type": "user", "name": user, "auth": {"accessToken": {"role": role}}})

    def h_validate_yaml(self, request: Request, **_: Any) -> Response:
        content = self._body(request).get("content", "")
        m = re.match(r"^---\s*\n(.*?)\n---\s*(\n|$)", content, re.S)
        if m:
            try:
                meta = yaml.safe_load(m.group(1))
            except yaml.YAMLError as e:
                return _json({"errors": [{"message": f"invalid YAML: {e}"}], "warnings": []}, 400)
            if meta is not None and not isinstance(meta, dict):
                return _json({"errors": [{"message": "metadata must be a mapping"}], "warnings": []}, 400)
        return _json({"errors": [], "warnings": []})

    def h_create_repo(self, request: Request, **_: Any) -> Response:
        user = self._user(request, write=True)
        body = self._body(request)
        if body.get("type", "model") not in (None, "model"):
            raise HubFail(400, "this test server only hosts model repos")
        name, org = body.get("name"), body.get("organization") or user
        if not name or not re.fullmatch(r"[\w.-]+", name) or not re.fullmatch(r"[\w.-]+", org):
            raise HubFail(400, f"invalid repo name {org}/{name}")
        private = body.get("visibility") == "private" or body.get("private") is True
        repo_id = f"{org}/{name}"
        url = f"{request.host_url.rstrip('/')}/{repo_id}"
        if self.store.create_repo(repo_id, private=private, author=user) is None:
            raise HubFail(409, "You already created this model repo", url=url)
        return _json({"url": url, "name": repo_id, "id": repo_id})

    def h_repo_info(self, request: Request, org: str, name: str, rev: str = "main", **_: Any) -> Response:
        repo, _user = self._repo(request, org, name)
        commit = self._rev(repo, rev)
        return _json(
            {
                "_id": repo.repo_id,
                "id": repo.repo_id,
                "modelId": repo.repo_id,
                "author": org,
                "sha": commit.oid,
                "lastModified": hub_date(commit.date),
                "createdAt": hub_date(repo.created),
                "private": repo.private,
                "disabled": False,
                "gated": False,
                "downloads": 0,
                "likes": 0,
                "tags": [],
                "siblings": [{"rfilename": p} for p in sorted(commit.tree)],
            }
        )

    def h_refs(self, request: Request, org: str, name: str, **_: Any) -> Response:
        repo, _user = self._repo(request, org, name)
        with self.store.lock:
            branches = [
                {"name": b, "ref": f"refs/heads/{b}", "targetCommit": oid}
                for b, oid in sorted(repo.branches.items())
            ]
            tags = [
                {"name": t, "ref": f"refs/tags/{t}", "targetCommit": oid}
                for t, oid in sorted(repo.tags.items())
            ]
        return _json({"branches": branches, "converts": [], "tags": tags, "pullRequests": []})

    def h_commits(self, request: Request, org: str, name: str, rev: str, raw_path: str, **_: Any) -> Response:
        repo, _user = self._repo(request, org, name)
        limit = _int_arg(request, "limit", self.config.commits_page_size, 1)
        page = _int_arg(request, "p", 0, 0)
        limit = min(limit, self.config.commits_page_max)
        with self.store.lock:
            history = repo.history(self._rev(repo, rev))
        items = [
            {
                "id": c.oid,
                "title": c.title,
                "message": c.message,
                "authors": [{"user": c.author, "avatar": None}],
                "date": hub_date(c.date),
            }
            for c in history[page * limit : (page + 1) * limit]
        ]
        with self.stats.lock:
            self.stats.commits_served += len(items)
        headers = {}
        if (page + 1) * limit < len(history):
            params = {**request.args.to_dict(), "limit": str(limit), "p": str(page + 1)}
            headers["Link"] = f'<{request.host_url.rstrip("/")}{raw_path}?{urlencode(params)}>; rel="next"'
        return _json(items, 200, headers)

    def h_tree(self, request: Request, org: str, name: str, rev: str, raw_path: str, sub: str = "", **_: Any):
        repo, _user = self._repo(request, org, name)
        commit = self._rev(repo, rev)
        recursive = request.args.get("recursive", "false").lower() in ("1", "true")
        entries = list_tree(commit.tree, sub, recursive)
        if sub and not entries:
            raise HubFail(404, f"{sub} does not exist on {rev}", "EntryNotFound")
        items = []
        for kind, path, blob in entries:
            if blob is None:
                items.append(
                    {"type": "directory", "oid": folder_oid(commit.tree, path), "size": 0, "path": path}
                )
                continue
            item: dict[str, Any] = {"type": kind, "oid": blob.git_oid, "size": blob.size, "path": path}
            if blob.is_lfs:
                item["lfs"] = {"oid": blob.sha256, "size": blob.size, "pointerSize": blob.pointer_size}
            items.append(item)
        return self._page(request, raw_path, items, self.config.tree_page_size, "cursor")

    def h_tag(self, request: Request, org: str, name: str, rev: str, **_: Any) -> Response:
        repo, _user = self._repo(request, org, name, write=True)
        with self.store.lock:
            if request.method == "DELETE":
                if repo.tags.pop(rev, None) is None:
                    raise HubFail(404, f"tag {rev} not found", "RevisionNotFound")
                return _json({})
            tag = self._body(request).get("tag")
            if not tag or not re.fullmatch(r"[\w.-]+", tag):
                raise HubFail(400, f"invalid tag name {tag!r}")
            if tag in repo.tags:
                raise HubFail(409, f"Tag {tag} already exists")
            repo.tags[tag] = self._rev(repo, rev).oid
        return _json({})

    def h_branch(self, request: Request, org: str, name: str, rev: str, **_: Any) -> Response:
        repo, _user = self._repo(request, org, name, write=True)
        with self.store.lock:
            if request.method == "DELETE":
                if rev == "main" or repo.branches.pop(rev, None) is None:
                    raise HubFail(404 if rev != "main" else 403, f"cannot delete branch {rev}")
                return _json({})
            if rev in repo.branches:
                raise HubFail(409, f"Reference already exists: refs/heads/{rev}")
            start = self._body(request).get("startingPoint") or "main"
            repo.branches[rev] = self._rev(repo, start).oid
        return _json({})

    # --- uploads ------------------------------------------------------------------------------------

    def h_preupload(self, request: Request, org: str, name: str, rev: str, **_: Any) -> Response:
        repo, _user = self._repo(request, org, name, write=True)
        commit = self._rev(repo, rev)
        out = []
        for f in self._body(request).get("files", []):
            sample = base64.b64decode(f.get("sample", ""))
            lfs = f["path"].endswith(_LFS_SUFFIXES) or int(f["size"]) > _REGULAR_MAX or b"\0" in sample
            remote = commit.tree.get(f["path"])
            oid = None if remote is None else (remote.sha256 if remote.is_lfs else remote.git_oid)
            out.append(
                {
                    "path": f["path"],
                    "uploadMode": "lfs" if lfs else "regular",
                    "shouldIgnore": False,
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

    def h_commit(self, request: Request, org: str, name: str, rev: str, **_: Any) -> Response:
        repo, user = self._repo(request, org, name, write=True)
        lines = [json.loads(line) for line in request.get_data().splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise HubFail(400, "the first ndjson line must be the header")
        header = lines[0]["value"]
        with self.store.lock:
            if rev not in repo.branches:
                if repo.resolve(rev) is not None:
                    raise HubFail(400, f"{rev} is not a branch")
                raise HubFail(404, f"Invalid rev id: {rev}", "RevisionNotFound")
            head = repo.commits[repo.branches[rev]]
            parent = header.get("parentCommit")
            if parent is not None and parent != head.oid:
                raise HubFail(412, f"A commit has happened since {parent}. Please refresh and try again.")
            tree = dict(head.tree)
            for line in lines[1:]:
                self._apply(repo, tree, line.get("key"), line.get("value") or {})
            commit = self.store.commit(
                repo, rev, header.get("summary", ""), header.get("description", ""), user, tree
            )
        with self.stats.lock:
            self.stats.commits[repo.repo_id] += 1
        base = request.host_url.rstrip("/")
        return _json(
            {
                "success": True,
                "commitOid": commit.oid,
                "commitUrl": f"{base}/{repo.repo_id}/commit/{commit.oid}",
                "hookOutput": "",
            }
        )

    @staticmethod
    def _apply(repo: Repo, tree: dict[str, Blob], key: str | None, value: dict) -> None:
        path = value.get("path", "")
        if not path or path.startswith("/") or ".." in path.split("/"):
            raise HubFail(400, f"invalid path {path!r}")
        if key == "file":
            if value.get("encoding", "base64") != "base64":
                raise HubFail(400, "only base64 file content is supported")
            tree[path] = Blob.regular(base64.b64decode(value.get("content", "")))
        elif key == "lfsFile":
            oid = value.get("oid")
            if oid not in repo.lfs:
                raise HubFail(422, f"Your push was rejected: LFS object {oid} for {path} was never uploaded")
            if value.get("size") is not None and value["size"] != repo.lfs[oid]:
                raise HubFail(
                    422, f"LFS object {oid} for {path} has size {repo.lfs[oid]}, not {value['size']}"
                )
            tree[path] = Blob.lfs(oid, repo.lfs[oid])
        elif key == "deletedFile":
            if tree.pop(path, None) is None:
                raise HubFail(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
        elif key == "deletedFolder":
            for p in [p for p in tree if p.startswith(path.rstrip("/") + "/")]:
                del tree[p]
        else:
            raise HubFail(400, f"unknown commit operation {key!r}")

    # --- downloads ----------------------------------------------------------------------------------

    def h_resolve(self, request: Request, org: str, name: str, rev: str, file: str, **_: Any) -> Response:
        repo, _user = self._repo(request, org, name)
        commit = self._rev(repo, rev)
        blob = commit.tree.get(file)
        if blob is None:
            raise HubFail(404, f"Entry not found: {file}", "EntryNotFound", {"X-Repo-Commit": commit.oid})
        if blob.is_lfs:
            source: Any = str(self.store.lfs_path(blob.sha256))
            etag = blob.sha256
        else:
            source, etag = io.BytesIO(blob.content or b""), blob.git_oid
        response = send_file(
            source,
            request.environ,
            mimetype="application/octet-stream",
            etag=etag,
            conditional=True,
            max_age=None,
        )
        response.headers["X-Repo-Commit"] = commit.oid
        response.headers["Accept-Ranges"] = "bytes"
        return response


def _drop_connection(environ: dict) -> None:
    """Close the client's socket without an answer; werkzeug treats the error as a dropped connection."""
    sock: socket.socket = environ["werkzeug.socket"]
    sock.shutdown(socket.SHUT_RDWR)
    raise ConnectionAbortedError("injected fault: connection dropped")


def _int_arg(request: Request, name: str, default: int, minimum: int) -> int:
    value = request.args.get(name)
    if value is None:
        return default
    if not value.isdigit() or int(value) < minimum:
        raise HubFail(400, f"invalid {name}={value!r}: expected an integer >= {minimum}")
    return int(value)


def _json(data: Any, status: int = 200, headers: dict | None = None) -> Response:
    response = Response(json.dumps(data), status=status, mimetype="application/json")
    for k, v in (headers or {}).items():
        response.headers[k] = v
    return response
