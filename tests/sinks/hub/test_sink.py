"""HubSink against the Hub-protocol test server, driven by the real huggingface_hub and hf_xet clients.

Uploads take the production path, Xet; the LFS path has its own tests in tests/sinks/hub/test_lfs.py."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
from huggingface_hub import (
    HfApi,
    get_hf_file_metadata,
    hf_hub_download,
    hf_hub_url,
    snapshot_download,
)
from huggingface_hub.utils import get_session
from safetensors.numpy import save_file

from stagerd.errors import SinkAuthError, SinkConflictError, SinkError, VerifyError
from stagerd.sinks.base import Sink
from stagerd.sinks.hub import (
    HubSink,
    step_branch,
)
from tests.cli_helpers import run_cli
from tests.hubserver import Fault, HubConfig, HubServer

REPO = "acme/llm"
# Small enough for a fast test, big enough that the large shard goes multipart (3 parts) and the
# tree and commit listings span several pages.
CONFIG = HubConfig(
    multipart_threshold=256 * 1024, multipart_chunk_size=120 * 1024, tree_page_size=3, commits_page_size=2
)


def write_export(out: Path, *, seed: int = 0, shards: int = 2) -> Path:
    """A small HF export as save_pretrained lays it out: `shards` safetensors files (the first over the
    multipart threshold) with an index, or one `model.safetensors` without, and a config.json."""
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    weight_map, total = {}, 0
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors" if shards > 1 else "model.safetensors"
        rows = 160 if i == 0 else 10
        tensors = {f"layers.{i}.w": rng.standard_normal((rows, 1024), dtype=np.float32).astype(np.float16)}
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.nbytes for t in tensors.values())
    if shards > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps({"model_type": "llama", "seed": seed}))
    return out


def make_sink(hub: HubServer, url: str = f"hf://{REPO}", **options) -> HubSink:
    options = {
        "token": hub.token,
        "endpoint": hub.endpoint,
        "backoff_base": 0.01,
        "backoff_max": 0.05,
        **options,
    }
    return HubSink.from_url(url, **options)


def export_files(export: Path) -> dict[str, bytes]:
    return {p.relative_to(export).as_posix(): p.read_bytes() for p in export.rglob("*") if p.is_file()}


def remote_paths(hub: HubServer, revision: str) -> set[str]:
    api = HfApi(endpoint=hub.endpoint, token=hub.token)
    return {f.path for f in api.list_repo_tree(REPO, recursive=True, revision=revision) if hasattr(f, "size")}


def test_publish_downloads_back_byte_for_byte(hub, tmp_path):
    export = write_export(tmp_path / "export")
    sink = make_sink(hub)
    assert isinstance(sink, Sink)

    result = sink.publish(export, 100, metadata={"run": "sft-7", "base_model": "acme/base"})

    assert not result.skipped and result.step == 100 and result.files == 5
    assert result.bytes_total > sum(len(b) for b in export_files(export).values())  # plus the card
    assert hub.stats.commits[REPO] == 1
    assert hub.stats.count("POST", r"/v1/shards$", status=200) == 1  # both shards, one Xet upload
    assert hub.stats.xorb_uploads and not hub.stats.count("POST", r"/info/lfs/")  # Xet, not LFS
    assert hub.store.repos[REPO].private
    api = HfApi(endpoint=hub.endpoint, token=hub.token)
    refs = api.list_repo_refs(REPO)
    (tag,) = refs.tags
    assert tag.name == "step-100"
    assert tag.target_commit == next(b.target_commit for b in refs.branches if b.name == "main")
    assert api.list_repo_commits(REPO)[0].title == "stagerd: step 100"

    local = snapshot_download(
        REPO, revision="step-100", endpoint=hub.endpoint, token=hub.token, local_dir=tmp_path / "dl"
    )
    for rel, data in export_files(export).items():
        assert (Path(local) / rel).read_bytes() == data, rel
    card = (Path(local) / "README.md").read_text()
    assert "step **100**" in card and "F16" in card and "acme/base" in card and "sft-7" in card
    assert card.startswith("---\nbase_model: acme/base\n")


def test_rerun_is_a_noop(hub, tmp_path):
    export = write_export(tmp_path / "export")
    sink = make_sink(hub)
    first = sink.publish(export, 3)
    uploads = dict(hub.stats.lfs_uploads)
    received = hub.stats.bytes_received

    again = make_sink(hub).publish(export, 3)

    assert again.skipped and again.bytes_uploaded == 0 and again.location == first.location
    assert hub.stats.commits[REPO] == 1
    assert dict(hub.stats.lfs_uploads) == uploads and hub.stats.bytes_received == received
    assert hub.stats.count("POST", r"/commit/") == 1
    assert sink.is_published(3) and not sink.is_published(4)


def test_crash_between_commit_and_tag_adds_only_the_tag(hub, tmp_path):
    export = write_export(tmp_path / "export")
    hub.faults.add(Fault("POST", r"/tag/", status=500, times=100))
    with pytest.raises(SinkError, match="gave up after 2 attempts"):
        make_sink(hub, max_attempts=2).publish(export, 7)
    assert (
        hub.stats.commits[REPO] == 1
        and not HfApi(endpoint=hub.endpoint, token=hub.token).list_repo_refs(REPO).tags
    )
    hub.faults.clear()
    received = hub.stats.bytes_received

    result = make_sink(hub).publish(export, 7)

    assert result.skipped and result.bytes_uploaded == 0
    assert hub.stats.commits[REPO] == 1 and hub.stats.bytes_received == received
    refs = HfApi(endpoint=hub.endpoint, token=hub.token).list_repo_refs(REPO)
    assert [t.name for t in refs.tags] == ["step-7"]
    assert refs.tags[0].target_commit == refs.branches[0].target_commit


def test_commit_whose_answer_is_lost_is_not_committed_twice(hub, tmp_path):
    export = write_export(tmp_path / "export")
    hub.faults.add(Fault("POST", r"/commit/", drop=True, drop_response=True))

    result = make_sink(hub).publish(export, 8)

    assert hub.stats.count("POST", r"/commit/") == 1 and hub.stats.commits[REPO] == 1
    assert result.skipped  # the retry found the commit by its message and only tagged it
    assert make_sink(hub).is_published(8)


def test_5xx_and_429_with_retry_after_are_retried(hub, tmp_path):
    export = write_export(tmp_path / "export")
    hub.faults.add(Fault("GET", r"/refs$", status=429, headers={"Retry-After": "1"}))
    hub.faults.add(Fault("POST", r"/commit/", status=500, times=2))
    hub.faults.add(Fault("POST", r"/repos/create", status=502))

    make_sink(hub).publish(export, 11)

    refs_times = hub.stats.times("GET", r"/refs$")
    assert refs_times[1] - refs_times[0] >= 1.0  # waited for Retry-After, not the 0.01 s backoff
    assert hub.stats.count("POST", r"/commit/", status=500) == 2
    assert hub.stats.commits[REPO] == 1
    assert [t.name for t in HfApi(endpoint=hub.endpoint, token=hub.token).list_repo_refs(REPO).tags] == [
        "step-11"
    ]


def test_server_down_then_up(hub, tmp_path):
    export = write_export(tmp_path / "export")
    hub.down_for(0.6)

    result = make_sink(hub, backoff_base=0.2, backoff_max=0.4).publish(export, 13)

    assert not result.skipped and hub.stats.commits[REPO] == 1


def test_bad_token_is_a_clear_auth_error_without_the_token(hub, tmp_path, caplog, capfd):
    export = write_export(tmp_path / "export")
    bad = "hf_" + "Zq9" * 12
    caplog.set_level(logging.DEBUG)

    with pytest.raises(SinkAuthError) as info:
        make_sink(hub, token=bad).publish(export, 14)

    err = info.value
    assert not err.retryable and "401" in str(err) and "hf://acme/llm: step 14" in str(err)
    assert "Invalid credentials" in str(err)
    out, errout = capfd.readouterr()
    for text in (str(err), err.hint, repr(err), caplog.text, out, errout):
        assert bad not in text
    assert hub.stats.count("POST", r"/repos/create") == 1  # not retried
    assert REPO not in hub.store.repos


def test_read_only_token_is_an_auth_error(hub, tmp_path):
    HfApi(endpoint=hub.endpoint, token=hub.token).create_repo(REPO, private=True)
    with pytest.raises(SinkAuthError, match="403"):
        make_sink(hub, token=hub.read_token).publish(write_export(tmp_path / "export"), 15)
    assert hub.stats.commits[REPO] == 0


def test_permanent_failure_is_a_sink_error_and_nothing_is_tagged(hub, tmp_path):
    export = write_export(tmp_path / "export")
    before = export_files(export)
    hub.faults.add(Fault("POST", r"/commit/", status=503, times=1000))

    with pytest.raises(SinkError, match=r"step 16: gave up after 3 attempts: HTTP 503 on POST") as info:
        make_sink(hub, max_attempts=3).publish(export, 16)

    assert info.value.retryable
    assert hub.stats.count("POST", r"/commit/") == 3
    assert not make_sink(hub).is_published(16)
    assert export_files(export) == before


def test_token_comes_from_hf_token_and_never_shows_in_the_url(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", hub.token)
    sink = HubSink.from_url(f"hf://{REPO}@main?endpoint={hub.endpoint}&private=false")
    assert sink.url == f"hf://{REPO}@main" and hub.token not in repr(sink)

    sink.publish(write_export(tmp_path / "export"), 17)

    assert not hub.store.repos[REPO].private
    in_query = HubSink.from_url(f"hf://{REPO}?token={hub.token}&endpoint={hub.endpoint}")
    assert in_query.url == f"hf://{REPO}" and hub.token not in repr(in_query)


def test_main_holds_exactly_the_latest_step(hub, tmp_path):
    sink = make_sink(hub)
    sink.publish(write_export(tmp_path / "a", seed=1, shards=2), 20)
    sink.publish(write_export(tmp_path / "b", seed=2, shards=1), 30)

    assert remote_paths(hub, "main") == {
        ".gitattributes",
        "README.md",
        "config.json",
        "model.safetensors",
    }
    sharded = {"model-00002-of-00002.safetensors", "model.safetensors.index.json"}
    assert sharded <= remote_paths(hub, "step-20")
    assert hub.stats.commits[REPO] == 2


def test_an_older_step_does_not_move_main(hub, tmp_path):
    sink = make_sink(hub)
    sink.publish(write_export(tmp_path / "a", seed=1), 50)
    main_before = remote_paths(hub, "main")

    sink.publish(write_export(tmp_path / "b", seed=2), 40)

    api = HfApi(endpoint=hub.endpoint, token=hub.token)
    assert api.list_repo_commits(REPO, revision="main")[0].title == "stagerd: step 50"
    assert api.list_repo_commits(REPO, revision=step_branch(40))[0].title == "stagerd: step 40"
    assert remote_paths(hub, "main") == main_before
    assert {t.name for t in api.list_repo_refs(REPO).tags} == {"step-40", "step-50"}


def test_branch_per_step(hub, tmp_path):
    export = write_export(tmp_path / "export")
    sink = make_sink(hub, branch_per_step=True)

    sink.publish(export, 60)
    assert sink.publish(export, 60).skipped

    api = HfApi(endpoint=hub.endpoint, token=hub.token)
    branches = {b.name for b in api.list_repo_refs(REPO).branches}
    assert branches == {"main", "stagerd/step-60"}
    assert api.list_repo_commits(REPO, revision="main")[0].title == "initial commit"
    path = hf_hub_download(
        REPO,
        "config.json",
        revision="stagerd/step-60",
        endpoint=hub.endpoint,
        token=hub.token,
        cache_dir=tmp_path / "cache",
    )
    assert Path(path).read_bytes() == (export / "config.json").read_bytes()
    assert hub.stats.commits[REPO] == 1


def test_same_step_with_other_content_is_a_conflict(hub, tmp_path):
    sink = make_sink(hub)
    sink.publish(write_export(tmp_path / "a", seed=1), 70)
    with pytest.raises(SinkConflictError, match=r"step 70 at commit [0-9a-f]{40}.*model-00001-of-00002"):
        sink.publish(write_export(tmp_path / "b", seed=2), 70)
    assert hub.stats.commits[REPO] == 1


def test_verification_reads_the_remote_tree(hub, tmp_path):
    export = write_export(tmp_path / "export")
    sink = make_sink(hub)
    sink.publish(export, 80)
    repo = hub.store.repos[REPO]
    commit = repo.commits[repo.tags["step-80"]]
    del commit.tree["config.json"]  # the server loses a file behind the client's back

    with pytest.raises(SinkConflictError, match=r"config\.json: missing"):
        sink.publish(export, 80)


def test_export_readme_is_kept(hub, tmp_path):
    export = write_export(tmp_path / "export")
    (export / "README.md").write_text("---\nlicense: apache-2.0\n---\n# mine\n")
    make_sink(hub).publish(export, 90)
    path = hf_hub_download(
        REPO,
        "README.md",
        revision="step-90",
        endpoint=hub.endpoint,
        token=hub.token,
        cache_dir=tmp_path / "c",
    )
    assert Path(path).read_text() == "---\nlicense: apache-2.0\n---\n# mine\n"


@pytest.mark.parametrize("xet", [True, False], ids=["xet", "lfs"])
def test_a_step_whose_files_all_equal_the_last_steps_gets_its_own_commit(hub, tmp_path, xet):
    # huggingface_hub skips a commit whose every file is unchanged and answers with the branch head:
    # tagging that would mark step 90's commit as step 91, which no later run then counts as published.
    export = write_export(tmp_path / "export", shards=1)
    (export / "README.md").write_text("# mine\n")  # the export's own card: nothing names the step
    sink = make_sink(hub)
    sink.publish(export, 90)

    result = sink.publish(export, 91)

    api = HfApi(endpoint=hub.endpoint, token=hub.token)
    tags = {t.name: t.target_commit for t in api.list_repo_refs(REPO).tags}
    assert tags["step-91"] != tags["step-90"] and result.location.endswith(tags["step-91"])
    assert [c.title for c in api.list_repo_commits(REPO)][:2] == ["stagerd: step 91", "stagerd: step 90"]
    assert remote_paths(hub, "step-91") == remote_paths(hub, "step-90")
    assert make_sink(hub).is_published(91) and make_sink(hub).publish(export, 91).skipped


def test_bad_exports_are_named_errors(hub, tmp_path):
    sink = make_sink(hub)
    assert not sink.is_published(1)  # no repo yet: not published, and not created by asking
    assert REPO not in hub.store.repos
    with pytest.raises(VerifyError, match="does not exist"):
        sink.publish(tmp_path / "missing", 1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(VerifyError, match="empty"):
        sink.publish(tmp_path / "empty", 1)
    export = write_export(tmp_path / "export")
    (tmp_path / "secret").write_text("x")
    os.symlink(tmp_path / "secret", export / "leak.txt")
    with pytest.raises(VerifyError, match=r"leak\.txt.*outside the export"):
        sink.publish(export, 1)
    assert hub.stats.count("POST", r"/commit/") == 0


def test_server_resolve_head_and_range(hub, tmp_path):
    export = write_export(tmp_path / "export")
    make_sink(hub).publish(export, 1)
    url = hf_hub_url(REPO, "model-00001-of-00002.safetensors", revision="step-1", endpoint=hub.endpoint)
    meta = get_hf_file_metadata(url, token=hub.token)
    data = (export / "model-00001-of-00002.safetensors").read_bytes()
    assert meta.size == len(data) and meta.commit_hash and len(meta.etag) == 64
    r = get_session().get(url, headers={"Authorization": f"Bearer {hub.token}", "Range": "bytes=100-199"})
    assert r.status_code == 206 and r.content == data[100:200]
    assert get_session().get(url).status_code == 404  # private: anonymous readers do not see it


def test_cli_publish_reads_hf_endpoint_and_hf_token_from_the_environment(hub, tmp_path):
    export = write_export(tmp_path / "step-00000042" / "export")
    env = {"HF_ENDPOINT": hub.endpoint, "HF_TOKEN": hub.token, "HF_HUB_DISABLE_XET": None}
    args = ["publish", export, "--sink", f"hf://{REPO}"]

    first = run_cli(args, env=env)
    again = run_cli(args, env=env)

    assert first.returncode == 0, first.stderr
    assert again.returncode == 0, again.stderr
    assert hub.stats.commits[REPO] == 1
    assert make_sink(hub).is_published(42)
    assert hub.token not in first.stdout + first.stderr + again.stdout + again.stderr
    bad = run_cli(args, env={**env, "HF_TOKEN": "hf_" + "N0pe" * 8})
    assert bad.returncode == 2 and "SinkAuthError" in bad.stderr + bad.stdout
    assert "N0peN0pe" not in bad.stderr + bad.stdout


def test_an_older_step_does_not_move_main_past_a_users_commit(hub, tmp_path):
    """A person edits the card on main after step 50; step 40 (a retry, or a slower worker) comes later.
    Before the fix only the head commit's title was read: a head not made by stagerd counted as "no step",
    so step 40 went onto main and put its weights back over step 50's."""
    sink = make_sink(hub)
    sink.publish(write_export(tmp_path / "a", seed=1), 50)
    api = HfApi(endpoint=hub.endpoint, token=hub.token)
    api.upload_file(
        path_or_fileobj=b"# my model\n",
        path_in_repo="README.md",
        repo_id=REPO,
        commit_message="Update README.md",
    )
    head = api.list_repo_commits(REPO, revision="main")[0].commit_id

    sink.publish(write_export(tmp_path / "b", seed=2), 40)

    assert api.list_repo_commits(REPO, revision="main")[0].commit_id == head
    assert api.list_repo_commits(REPO, revision=step_branch(40))[0].title == "stagerd: step 40"
    assert {t.name for t in api.list_repo_refs(REPO).tags} == {"step-40", "step-50"}
