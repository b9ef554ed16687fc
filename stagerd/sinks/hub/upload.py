"""The uploads of one step's commit: which files go inline in the commit and which through Xet, and the bytes
that went over the wire.

First, on either path, the sink asks the Hub each added file's upload mode (`_fetch_upload_modes`: one
preupload request per 256 files), which also says whether the repo's `.gitignore` on the branch matches the
file (`_should_ignore`): huggingface_hub would leave such a file out of the upload and the commit without a
word, so the step is refused (`IgnoredFilesError`) before anything is sent. `create_commit` asks no mode
that is already known, so this costs no request the commit would not have made.

Through Xet (the default wherever hf_xet is installed) the sink then does what huggingface_hub's own upload
pipeline does before `create_commit`: it uploads the LFS-mode files through its own `XetUploader`, and marks
those operations uploaded (`_is_uploaded`), so `create_commit` only commits them. Those names are private
to huggingface_hub; `LIBRARY_SEAMS` lists them and a test fails if one moves.

Without Xet (`HF_HUB_DISABLE_XET=1`) `create_commit` uploads through the LFS protocol as it always has, and
the bytes sent are counted as the files' sizes (the Hub may already hold an object, after a crash
mid-upload, and then it is not sent again).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from stagerd.errors import IgnoredFilesError
from stagerd.sinks.hub.model_card import CARD_NAME
from stagerd.sinks.hub.tree import CommitPlan, HubFile
from stagerd.sinks.hub.xet import XetFile, XetUploader, xet_enabled

# (module, attribute) pairs of huggingface_hub's private API this module relies on.
LIBRARY_SEAMS = (
    ("huggingface_hub._commit_api", "_fetch_upload_modes"),
    ("huggingface_hub.utils._xet", "xet_connection_info_refresh_url"),
)
OPERATION_SEAMS = ("_upload_mode", "_should_ignore", "_is_uploaded", "_remote_oid")  # of CommitOperationAdd


@dataclass(frozen=True)
class Sent:
    """What one commit's uploads sent: file bytes over the wire, and how (`xet`, `lfs` or `inline`)."""

    bytes: int
    via: str


def ask_upload_modes(
    api: Any, repo_id: str, branch: str, additions: Sequence[Any], headers: dict[str, str], *, where: str
) -> None:
    """Set each of `additions`' upload mode, remote oid and `_should_ignore` from the Hub's preupload
    answer, and refuse the step if the repo's `.gitignore` on `branch` matches any of them. A `.gitignore`
    that the step adds is sent as the rules, as `create_commit` would. `where` names the sink and step."""
    if not additions:
        return
    content = None
    for op in additions:
        if op.path_in_repo == ".gitignore":
            with op.as_file() as f:
                content = f.read().decode()
    _modes(api, repo_id, branch, additions, headers, content)
    ignored = [op.path_in_repo for op in additions if op._should_ignore]
    if ignored:
        raise _ignored_error(ignored, repo_id, branch, where)


def _modes(
    api: Any, repo_id: str, branch: str, ops: Sequence[Any], headers: dict[str, str], gitignore: str | None
) -> None:
    """Each of `ops`' upload mode, remote oid and `_should_ignore`, from the Hub's preupload answer (one
    request per 256 files); `gitignore`: the rules a `.gitignore` the commit adds would make."""
    from huggingface_hub._commit_api import _fetch_upload_modes

    _fetch_upload_modes(
        additions=list(ops),
        repo_type="model",
        repo_id=repo_id,
        headers=headers,
        revision=quote(branch, safe=""),
        endpoint=api.endpoint,
        gitignore_content=gitignore,
    )


def _ignored_error(paths: Sequence[str], repo_id: str, branch: str, where: str) -> IgnoredFilesError:
    shown = ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")
    return IgnoredFilesError(
        f"{where}: the .gitignore of {repo_id} on branch {branch} matches {shown}, which the Hub would "
        "leave out of the step's commit; nothing was committed",
        hint=(
            f"remove the rule that matches from .gitignore on branch {branch} of {repo_id}, or publish to "
            "another repo or revision; then `stagerd retry ROOT --step N`"
        ),
    )


def commit_operations(
    export_dir: Path, local: Sequence[HubFile], card_bytes: bytes | None, plan: CommitPlan
) -> tuple[list[Any], list[Any]]:
    """The commit's operations: an add for each file the parent lacks (`plan.adds`), and the deletes."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    adds = set(plan.adds)
    additions: list[Any] = []
    for f in local:
        if f.path not in adds:
            continue
        op = CommitOperationAdd(path_in_repo=f.path, path_or_fileobj=str(export_dir / f.path))
        op.upload_info.sha256 = bytes.fromhex(f.sha256)  # hashed once already, in scan_export
        additions.append(op)
    if card_bytes is not None and CARD_NAME in adds:
        additions.append(CommitOperationAdd(path_in_repo=CARD_NAME, path_or_fileobj=card_bytes))
    deletes = [CommitOperationDelete(path_in_repo=p, is_folder=False) for p in plan.deletes]
    return additions, deletes


def unchanged_operation(
    api: Any,
    repo_id: str,
    branch: str,
    export_dir: Path,
    local: Sequence[HubFile],
    card_bytes: bytes | None,
    headers: dict[str, str],
) -> Any:
    """An add of the export's smallest file, which the parent holds unchanged, that `create_commit` sends.

    For a step whose every file equals its parent's, `create_commit` drops each add as a no-op and, left
    with none, makes no commit and answers with the branch head: the step would be tagged on another
    commit (the last step's), which no later run counts as this step. Re-adding one file makes the step
    its own commit, with the parent's tree. Its upload mode is asked here, and its remote oid left unset
    so that it is not dropped; a file in LFS or Xet needs no upload, as the parent holds its object. Where
    the repo's `.gitignore` matches it, huggingface_hub sends the commit without it: still the step's own
    commit with the parent's tree, so nothing of the step is lost and it is not refused.
    """
    from huggingface_hub import CommitOperationAdd

    files = [(f.size, f.path) for f in local]
    if card_bytes is not None:
        files.append((len(card_bytes), CARD_NAME))
    _, path = min(files)
    content = card_bytes if path == CARD_NAME and card_bytes is not None else str(export_dir / path)
    op = CommitOperationAdd(path_in_repo=path, path_or_fileobj=content)
    _modes(api, repo_id, branch, [op], headers, None)
    op._remote_oid = None
    op._is_uploaded = op._upload_mode == "lfs"
    return op


def send_additions(
    api: Any,
    repo_id: str,
    branch: str,
    additions: Sequence[Any],
    *,
    uploader: XetUploader,
    headers: dict[str, str],
    progress: Callable[[int], None] | None = None,
) -> Sent:
    """Upload what `create_commit` would for `additions` (CommitOperationAdd, their modes asked by
    `ask_upload_modes`), ahead of it, through Xet.

    Returns the bytes sent. Without Xet nothing is sent here and the additions' sizes are returned:
    `create_commit` sends them through LFS.
    """
    size = sum(op.upload_info.size for op in additions)
    if not additions:
        return Sent(0, "inline")
    if not xet_enabled():
        return Sent(size, "lfs")
    from huggingface_hub.utils._xet import XetTokenType, xet_connection_info_refresh_url

    revision = quote(branch, safe="")
    to_xet = [op for op in additions if op._upload_mode == "lfs"]
    inline = sum(op.upload_info.size for op in additions if op._upload_mode == "regular")
    if not to_xet:
        return Sent(inline, "inline")
    refresh_url = xet_connection_info_refresh_url(
        token_type=XetTokenType.WRITE,
        repo_id=repo_id,
        repo_type="model",
        revision=revision,
        endpoint=api.endpoint,
    )
    files = [XetFile(op.path_or_fileobj, op.upload_info.sha256.hex()) for op in to_xet]
    sent = uploader.upload(files, token_refresh_url=refresh_url, headers=headers, progress=progress)
    for op in to_xet:
        op._is_uploaded = True
    return Sent(sent + inline, "xet")
