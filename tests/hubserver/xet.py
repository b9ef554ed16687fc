"""The Xet half of the Hub test server: the Hub's CAS token endpoints and the CAS itself (xorb and shard
upload, reconstruction, ranged xorb reads), as hf_xet 1.8 and huggingface_hub 2.3 use them.

A mixin of `HubApp`, which supplies the store, the stats and the repo lookup. The CAS lives under
`/cas/<id>` of the same server, `<id>` new for each server: hf_xet keys its local chunk cache by the CAS URL,
and two servers on one port (one after the other) must not share a cache. What the client asks for that a
real CAS may decline is declined the way hf_xet falls back from: no global dedup (404 on
`/v1/chunks/...`), no upload grants (404 on `/v1/xorb-grants/...`, so xorbs are POSTed), no v2 shard or
reconstruction API (404, so v1 is used).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

from werkzeug.wrappers import Request, Response

from tests.hubserver.store import Repo
from tests.hubserver.wire import HubFail, _json
from tests.hubserver.xet_format import XetFormatError, hash_raw, parse_shard
from tests.hubserver.xet_store import CasToken, XetCas, merged_fetch_ranges

_HEX64 = "0123456789abcdef"


def _hash_arg(value: str) -> str:
    try:
        hash_raw(value)
    except XetFormatError:
        raise HubFail(400, f"malformed hash {value!r} in the path") from None
    if value.strip(_HEX64):
        raise HubFail(400, f"hash {value!r} is not lowercase hex")
    return value


class XetEndpoints:
    """`h_xet_token` on the Hub side; `h_cas_*` for the CAS; `h_telemetry` for hf_xet's reports."""

    cas: XetCas
    cas_id: str
    _signing_key: bytes

    # --- the Hub: tokens ---------------------------------------------------------------------------

    def cas_url(self, request: Request) -> str:
        return f"{request.host_url.rstrip('/')}/cas/{self.cas_id}"

    def h_xet_token(self, request: Request, org: str, name: str, kind: str, rev: str, **_: Any) -> Response:
        if kind not in ("read", "write"):
            raise HubFail(404, f"no xet-{kind}-token endpoint")
        repo, _user = self._repo(request, org, name, write=kind == "write")
        self._rev(repo, rev)
        token, expires = self.cas.issue(repo.repo_id, kind)
        cas_url = self.cas_url(request)
        headers = {
            "X-Xet-Cas-Url": cas_url,
            "X-Xet-Access-Token": token,
            "X-Xet-Token-Expiration": str(expires),
        }
        with self.stats.lock:
            self.stats.xet_tokens[kind] += 1
        return _json({"accessToken": token, "exp": expires, "casUrl": cas_url}, 200, headers)

    def xet_headers(self, request: Request, repo: Repo, commit_oid: str, xet_hash: str) -> dict[str, str]:
        """What `resolve` adds for a Xet file: its hash and where to get a read token."""
        route = f"{request.host_url.rstrip('/')}/api/models/{repo.repo_id}/xet-read-token/{commit_oid}"
        return {"X-Xet-Hash": xet_hash, "X-Xet-Refresh-Route": route, "Link": f'<{route}>; rel="xet-auth"'}

    # --- the CAS ------------------------------------------------------------------------------------

    def _cas_token(self, request: Request, cas: str, *, write: bool) -> CasToken:
        if cas != self.cas_id:
            raise HubFail(404, f"no CAS {cas} on this server (a client cache from another server?)")
        header = request.headers.get("Authorization", "")
        token = self.cas.token(header.removeprefix("Bearer ").strip()) if header else None
        if token is None:
            raise HubFail(401, "missing, unknown or expired CAS token")
        if write and token.scope != "write":
            raise HubFail(403, "this CAS token can only read")
        return token

    def h_cas_chunk(self, request: Request, cas: str, prefix: str, hash: str, **_: Any) -> Response:
        self._cas_token(request, cas, write=False)
        _hash_arg(hash)
        raise HubFail(404, "chunk not tracked by global deduplication (this CAS keeps no global index)")

    def h_cas_xorb_grant(self, request: Request, cas: str, prefix: str, hash: str, **_: Any) -> Response:
        self._cas_token(request, cas, write=True)
        _hash_arg(hash)
        raise HubFail(404, "this CAS offers no upload grants: POST the xorb to /v1/xorbs")

    def h_cas_xorb(self, request: Request, cas: str, prefix: str, hash: str, **_: Any) -> Response:
        self._cas_token(request, cas, write=True)
        if prefix != "default":
            raise HubFail(400, f"xorb prefix must be 'default', not {prefix!r}")
        data = self._read_upload(request, "xorb")
        try:
            inserted = self.cas.put_xorb(_hash_arg(hash), data)
        except XetFormatError as e:
            raise HubFail(400, f"bad xorb {hash}: {e}") from None
        with self.stats.lock:
            self.stats.xorb_uploads[hash] += 1
        return _json({"was_inserted": inserted})

    def h_cas_shard_v2(self, request: Request, cas: str, **_: Any) -> Response:
        self._cas_token(request, cas, write=True)
        raise HubFail(404, "no v2 shard API here: use POST /v1/shards")

    def h_cas_shard(self, request: Request, cas: str, **_: Any) -> Response:
        token = self._cas_token(request, cas, write=True)
        data = self._read_upload(request, "shard")
        try:
            files = self.cas.register(parse_shard(data))
        except XetFormatError as e:
            raise HubFail(400, f"bad shard: {e}") from None
        store = self.store
        for f in files:
            if self.config.xet_materialize:
                try:
                    self.cas.materialize(f, store.lfs_path(f.sha256))
                except XetFormatError as e:
                    raise HubFail(400, f"bad shard: {e}") from None
            with store.lock:
                store.repos[token.repo_id].xet[f.sha256] = (f.file_hash, f.size)
        return _json({"result": 1})

    def _read_upload(self, request: Request, kind: str) -> bytes:
        """Read an upload body, counting its bytes as they arrive (a cut-off body still counts what came)."""
        chunks, n, hook = [], 0, self.lfs_hook
        try:
            while chunk := request.stream.read(1 << 20):
                chunks.append(chunk)
                n += len(chunk)
                if hook is not None and kind == "xorb":
                    hook.progress(n - len(chunk), n)
        finally:
            with self.stats.lock:
                self.stats.bytes_received += n
                self.stats.xet_bytes[kind] += n
        return b"".join(chunks)

    def h_cas_reconstruction(self, request: Request, cas: str, file_id: str, **_: Any) -> Response:
        token = self._cas_token(request, cas, write=False)
        info = self.cas.file(_hash_arg(file_id))
        repo = self.store.repos.get(token.repo_id)
        known = repo is not None and any(h == file_id for h, _ in repo.xet.values())
        if info is None or not known:
            raise HubFail(404, f"file {file_id} not found")
        terms, skip = list(info.terms), 0
        if (asked := request.range) is not None and asked.ranges:
            first, stop = asked.ranges[0]
            if first >= info.size:
                raise HubFail(416, f"range starts at {first}, the file has {info.size} bytes")
            stop = info.size if stop is None else min(stop, info.size)
            kept, at = [], 0
            for t in terms:
                if at + t.size > first and at < stop:
                    if not kept:
                        skip = first - at
                    kept.append(t)
                at += t.size
            terms = kept
        fetch: dict[str, list[dict[str, Any]]] = {}
        for xorb, ranges in merged_fetch_ranges(terms).items():
            url = f"{self.cas_url(request)}/xorbs/default/{xorb}?sig={self._sign(xorb)}"
            fetch[xorb] = []
            for start, end in ranges:
                lo, hi = self.cas.chunk_bytes(xorb, start, end)
                fetch[xorb].append(
                    {"range": {"start": start, "end": end}, "url": url, "url_range": {"start": lo, "end": hi}}
                )
        body = {
            "offset_into_first_range": skip,
            "terms": [
                {"hash": t.xorb, "unpacked_length": t.size, "range": {"start": t.start, "end": t.end}}
                for t in terms
            ],
            "fetch_info": fetch,
        }
        return _json(body)

    def h_cas_reconstruction_v2(self, request: Request, cas: str, file_id: str, **_: Any) -> Response:
        self._cas_token(request, cas, write=False)
        raise HubFail(404, "no v2 reconstruction API here: use /v1/reconstructions")

    def _sign(self, xorb: str) -> str:
        return hmac.new(self._signing_key, xorb.encode(), hashlib.sha256).hexdigest()[:32]

    def h_cas_xorb_read(self, request: Request, cas: str, hash: str, **_: Any) -> Response:
        """A presigned xorb URL from a reconstruction answer: `Range` is required, as on the Hub."""
        if cas != self.cas_id or not hmac.compare_digest(request.args.get("sig", ""), self._sign(hash)):
            raise HubFail(403, "bad or missing signature on the xorb URL")
        path = self.cas.xorb_path(_hash_arg(hash))
        asked = request.range
        if asked is None or len(asked.ranges) != 1 or not path.exists():
            raise HubFail(400 if path.exists() else 404, "a xorb is read one byte range at a time")
        size = path.stat().st_size
        start, stop = asked.ranges[0]
        stop = size if stop is None else min(stop, size)
        if start >= stop:
            raise HubFail(416, f"range {start}-{stop} outside the {size}-byte xorb")
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read(stop - start)
        with self.stats.lock:
            self.stats.xet_bytes["read"] += len(data)
        headers = {"Content-Range": f"bytes {start}-{stop - 1}/{size}", "Accept-Ranges": "bytes"}
        return Response(data, status=206, headers=headers, mimetype="application/octet-stream")

    def h_telemetry(self, request: Request, **_: Any) -> Response:
        """hf_xet's transfer report: accepted and kept (its byte counts are another view of the wire)."""
        try:
            doc = json.loads(request.get_data() or b"{}")
        except ValueError:
            raise HubFail(400, "telemetry body is not JSON") from None
        with self.stats.lock:
            self.stats.telemetry.append(doc)
        return _json({})
