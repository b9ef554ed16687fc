"""Read a published step back from the demo's first sink, the way a user of the model would get it."""

from __future__ import annotations

from pathlib import Path

from stagerd.contract import layout
from stagerd.demo.plan import DemoPlan
from stagerd.errors import VerifyError
from stagerd.sinks.fs_open import filesystem_at
from stagerd.sinks.objects import redact_url
from stagerd.sinks.urls import SinkKind, parse_sink_url


def published_copy(plan: DemoPlan, step: int) -> tuple[Path, str]:
    """(directory to check, what it is): the first sink's copy of the step, read back from the store.

    A local sink is read in place; the Hub (at the tag `step-N`) and any other store (s3://...) are
    downloaded into `downloaded/`, with the client's usual environment (HF_ENDPOINT, HF_TOKEN, AWS_*).
    """
    sink = parse_sink_url(plan.sinks[0])
    name = layout.step_dir_name(step)
    local = plan.downloaded / name
    if sink.kind is SinkKind.HUB:
        return _from_hub(sink.url, sink.location, step, local)
    if sink.kind is SinkKind.LOCAL:
        path = sink.local_path / name
        if not (path / layout.MANIFEST_NAME).is_file():
            raise VerifyError("the local sink holds no manifest for this step", path=path)
        return path, str(path)
    return _from_store(sink.url, step, local)


def _from_hub(url: str, repo_id: str, step: int, local: Path) -> tuple[Path, str]:
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import disable_progress_bars

    from stagerd.sinks.hub import parse_hub_url, step_tag

    disable_progress_bars()  # its tqdm bars, also off a terminal; the demo reports its own progress

    target = parse_hub_url(url)
    tag = step_tag(step, target.revision)  # a sink on @REVISION tags its steps there
    # no token in the URL: HF_TOKEN or the login, as the sink itself
    token, endpoint = target.options.get("token"), target.options.get("endpoint")
    snapshot_download(repo_id, revision=tag, local_dir=local, endpoint=endpoint, token=token)
    return local, f"hf://{repo_id}@{tag} (downloaded to {local})"


def _from_store(url: str, step: int, local: Path) -> tuple[Path, str]:
    name = layout.step_dir_name(step)
    fs, remote_root = filesystem_at(url, {})
    remote = f"{remote_root.rstrip('/')}/{name}"
    if not fs.exists(f"{remote}/{layout.MANIFEST_NAME}"):
        raise VerifyError(f"{redact_url(url)} holds no manifest for step {step}", path=remote)
    local.mkdir(parents=True, exist_ok=True)
    for path in fs.find(remote):
        rel = path[len(remote) + 1 :]
        layout.safe_relpath(rel, what="remote file", path=remote)
        (local / rel).parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(path, str(local / rel))
    return local, f"{redact_url(url)}/{name} (downloaded to {local})"
