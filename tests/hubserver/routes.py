"""The URL rules of the Hub test server: the subset of the Hub HTTP API (and Xet CAS) that huggingface_hub
2.3 and hf_xet 1.8 use.

Test infrastructure only. Requests and response fields follow the installed client
(`hf_api.py`, `_commit_api.py`, `lfs.py`, `file_download.py`, `utils/_pagination.py`):

- `POST /api/repos/create`, `GET /api/models/{repo}[/revision/{rev}]`, `GET /api/whoami-v2`,
  `GET /api/agent-harnesses` (the registry huggingface_hub reads for its user agent: empty here)
- `POST /api/validate-yaml` (create_commit checks a README.md's front matter with it)
- `POST /api/models/{repo}/preupload/{rev}` -> upload mode (lfs/regular) and the remote oid per file
- `POST /{repo}.git/info/lfs/objects/batch` -> basic (one PUT) or multipart (PUT per part, then POST
  completion) actions plus verify; objects the repo already holds get no actions (no re-upload)
- `POST /api/models/{repo}/commit/{rev}`: ndjson header (`summary`, `description`, `parentCommit`) then
  `file`, `lfsFile`, `deletedFile`, `deletedFolder` lines; a stale `parentCommit` is a 412
- `GET .../refs`, `GET .../commits/{rev}` (`limit` per page, `p` the page number, `Link` to the next)
  and `GET .../tree/{rev}[/{path}]` (paginated by `Link`),
  `POST|DELETE .../tag/{rev}`, `POST|DELETE .../branch/{name}`
- `GET|HEAD /{repo}/resolve/{rev}/{path}` with `X-Repo-Commit`, `ETag` and `Range`, plus `X-Xet-Hash` and the
  read-token route (`Link: <...>; rel="xet-auth"`) for a Xet file
- Xet: `GET /api/models/{repo}/xet-{read,write}-token/{rev}`, and the CAS under `/cas/{id}`: `POST
  /v1/xorbs/default/{hash}`, `POST /v1/shards`, `GET /v1/reconstructions/{file}`, ranged `GET
  /xorbs/default/{hash}`; declined with a 404, as hf_xet falls back from: `GET /v1/chunks/...` (global
  dedup), `POST /v1/xorb-grants/...`, `POST /v2/shards`, `GET /v2/reconstructions/...`; and hf_xet's
  `POST /v1/telemetry`

Routing matches the raw (still percent-encoded) path, so a revision like `a%2Fb` stays one segment.
"""

from __future__ import annotations

from werkzeug.routing import Map, Rule

URLS = Map(
    [
        Rule("/api/whoami-v2", endpoint="whoami", methods=["GET"]),
        Rule("/api/agent-harnesses", endpoint="agent_harnesses", methods=["GET"]),
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
        Rule("/api/models/<org>/<name>/xet-<kind>-token/<rev>", endpoint="xet_token", methods=["GET"]),
        Rule("/cas/<cas>/v1/chunks/<prefix>/<hash>", endpoint="cas_chunk", methods=["GET"]),
        Rule("/cas/<cas>/v1/xorb-grants/<prefix>/<hash>", endpoint="cas_xorb_grant", methods=["POST"]),
        Rule("/cas/<cas>/v1/xorbs/<prefix>/<hash>", endpoint="cas_xorb", methods=["POST"]),
        Rule("/cas/<cas>/v1/shards", endpoint="cas_shard", methods=["POST"]),
        Rule("/cas/<cas>/v2/shards", endpoint="cas_shard_v2", methods=["POST"]),
        Rule("/cas/<cas>/v1/reconstructions/<file_id>", endpoint="cas_reconstruction", methods=["GET"]),
        Rule("/cas/<cas>/v2/reconstructions/<file_id>", endpoint="cas_reconstruction_v2", methods=["GET"]),
        Rule("/cas/<cas>/xorbs/default/<hash>", endpoint="cas_xorb_read", methods=["GET"]),
        Rule("/v1/telemetry", endpoint="telemetry", methods=["POST"]),
    ]
)
