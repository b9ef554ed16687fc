"""HubSink against the Hub-protocol test server, driven by the real huggingface_hub and hf_xet clients.

Uploads take the production path, Xet; the LFS path has its own tests in tests/sinks/hub/test_lfs.py, and
the Hub's failures and refusals theirs in tests/sinks/hub/test_failures.py."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from huggingface_hub import (
    HfApi,
    get_hf_file_metadata,
    hf_hub_download,
    hf_hub_url,
    snapshot_download,
)
from huggingface_hub.utils import get_session

from stagerd.errors import SinkConflictError, SinkError, VerifyError
from stagerd.sinks.base import Sink
from stagerd.sinks.hub import (
    step_branch,
)
from tests.cli_helpers import run_cli
from tests.hubserver import Fault, HubServer
from tests.sinks.hub.hub_helpers import REPO, export_files, make_sink, write_export


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


def test_same_step_with_other_content_is_a_conflict_naming_the_account_and_date_of_its_commit(hub, tmp_path):
    """A Hub repo holds no claim naming a publisher's host and ROOT, as an S3 or file:// step does: the
    conflict names what the Hub records of the other run's commit, its account and date."""
    other = "hf_" + "0a" * 16
    hub.app.tokens[other] = ("other-lab", "write")  # a second account on the server
    make_sink(hub, token=other).publish(write_export(tmp_path / "a", seed=1), 70)
    with pytest.raises(SinkConflictError, match=r"step 70 at commit [0-9a-f]{40}.*model-00001-of-00002") as e:
        make_sink(hub).publish(write_export(tmp_path / "b", seed=2), 70)
    assert hub.stats.commits[REPO] == 1
    by = r", published by another run \(Hub account other-lab, \d{4}-\d\d-\d\d \d\d:\d\d UTC\), with "
    assert re.search(r"at commit [0-9a-f]{40}" + by, str(e.value)), e.value
    assert f"give each run its own repo or revision (hf://{REPO}@BRANCH)" in e.value.hint
    assert other not in f"{e.value} {e.value.hint}" and hub.token not in f"{e.value} {e.value.hint}"


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
