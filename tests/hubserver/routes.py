"""The URL rules of the Hub test server: the subset of the Hub HTTP API that huggingface_hub 2.4 uses.

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

from werkzeug.routing import Map, Rule

URLS = Map(
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
