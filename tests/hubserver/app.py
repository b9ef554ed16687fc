"""The WSGI application: the subset of the Hugging Face Hub HTTP API (and Xet CAS) that huggingface_hub 2.3
and hf_xet 1.8 use.

Test infrastructure only. The endpoints and their URL rules are in `routes`, the LFS upload endpoints in
`lfs`, the commit in `commit`, Xet (tokens and the CAS) in `xet`, shared types and helpers in `wire`.
"""

from __future__ import annotations

import io
import json
import re
import secrets
import time
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import unquote, urlencode

import yaml
from werkzeug.exceptions import HTTPException, MethodNotAllowed, NotFound
from werkzeug.utils import send_file
from werkzeug.wrappers import Request, Response

from tests.hubserver.commit import CommitEndpoints
from tests.hubserver.faults import Fault, FaultPlan
from tests.hubserver.lfs import LfsEndpoints, _Upload
from tests.hubserver.routes import URLS
from tests.hubserver.store import HubStore, Repo, folder_oid, hub_date, list_tree, valid_ref_name
from tests.hubserver.wire import (
    HubConfig,
    HubFail,
    HubStats,
    LfsBodyHook,
    RequestLog,
    _drop_connection,
    _int_arg,
    _json,
)
from tests.hubserver.xet import XetEndpoints
from tests.hubserver.xet_store import XetCas

__all__ = ["HubApp", "HubConfig", "HubFail", "HubStats", "LfsBodyHook"]


class HubApp(LfsEndpoints, CommitEndpoints, XetEndpoints):
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
        self.cas = XetCas(store.lfs_dir.parent / "xorbs", token_ttl=config.xet_token_ttl)
        self.cas_id = secrets.token_hex(8)
        self._signing_key = secrets.token_bytes(16)

    # --- plumbing -----------------------------------------------------------------------------------

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        request = Request(environ)
        raw = (environ.get("RAW_URI") or environ.get("REQUEST_URI") or request.path).split("?", 1)[0]
        fault = self.faults.take(request.method, unquote(raw))
        status = 0
        try:
            if fault is not None:
                fault.wait_turn()
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
                        request.headers.get("User-Agent", ""),
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
        response.direct_passthrough = False  # a file's answer (`send_file`) is read here like any other
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
            try:
                endpoint, args = URLS.bind_to_environ(request.environ).match(raw_path, method=request.method)
            except (NotFound, MethodNotAllowed):
                with self.stats.lock:
                    self.stats.unknown.append(f"{request.method} {unquote(raw_path)}")
                raise
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

    def h_agent_harnesses(self, request: Request, **_: Any) -> Response:
        return _json({"standardEnvVars": [], "harnesses": {}})

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
        expand = request.args.get("expand", "false").lower() in ("1", "true")
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
            if blob.xet_hash is not None:
                item["xetHash"] = blob.xet_hash
            if expand:
                last = repo.last_commit(commit, path)
                item["lastCommit"] = {"id": last.oid, "title": last.title, "date": hub_date(last.date)}
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
            if not tag or not valid_ref_name(tag):
                raise HubFail(400, f"invalid tag name {tag!r}")
            nested = [t for t in repo.tags if t.startswith(f"{tag}/") or tag.startswith(f"{t}/")]
            if nested:  # git keeps refs as paths: `a` and `a/b` cannot both be tags
                raise HubFail(400, f"tag {tag} conflicts with the existing tag {nested[0]}")
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
            if not valid_ref_name(rev):
                raise HubFail(400, f"invalid branch name {rev!r}")
            if rev in repo.branches:
                raise HubFail(409, f"Reference already exists: refs/heads/{rev}")
            nested = [b for b in repo.branches if b.startswith(f"{rev}/") or rev.startswith(f"{b}/")]
            if nested:  # as for tags: `a` and `a/b` cannot both be branches
                raise HubFail(400, f"branch {rev} conflicts with the existing branch {nested[0]}")
            start = self._body(request).get("startingPoint") or "main"
            repo.branches[rev] = self._rev(repo, start).oid
        return _json({})

    # --- downloads ----------------------------------------------------------------------------------

    def h_resolve(self, request: Request, org: str, name: str, rev: str, file: str, **_: Any) -> Response:
        repo, _user = self._repo(request, org, name)
        commit = self._rev(repo, rev)
        blob = commit.tree.get(file)
        if blob is None:
            raise HubFail(404, f"Entry not found: {file}", "EntryNotFound", {"X-Repo-Commit": commit.oid})
        if blob.is_lfs and not self.store.lfs_path(blob.sha256).exists():
            # A Xet file the server did not rebuild (`xet_materialize=False`): its metadata, no bytes.
            if request.method != "HEAD":
                raise HubFail(501, f"{file} is in Xet storage and not rebuilt here: download it through Xet")
            response = Response(status=200, mimetype="application/octet-stream")
            response.headers.update({"Content-Length": str(blob.size), "ETag": f'"{blob.sha256}"'})
        else:
            lfs = str(self.store.lfs_path(blob.sha256 or ""))
            source: Any = lfs if blob.is_lfs else io.BytesIO(blob.content or b"")
            response = send_file(
                source,
                request.environ,
                mimetype="application/octet-stream",
                etag=blob.sha256 if blob.is_lfs else blob.git_oid,
                conditional=True,
                max_age=None,
            )
        response.headers["X-Repo-Commit"] = commit.oid
        response.headers["Accept-Ranges"] = "bytes"
        if blob.xet_hash is not None:
            response.headers.update(self.xet_headers(request, repo, commit.oid, blob.xet_hash))
        return response
