"""Hub sinks on different revisions of one repo: each sink's steps (tags, step branches, commit titles) are
its own, so neither takes the other's step for published, nor refuses its own step for the other's.

Against the Hub-protocol test server, driven by the real huggingface_hub client."""

from __future__ import annotations

import pytest
from huggingface_hub import CommitOperationAdd, HfApi
from huggingface_hub.errors import HfHubHTTPError

from stagerd.errors import ConfigError, RestoreError, SinkConflictError
from stagerd.sinks.hub import commit_message, scan_history, step_branch, step_tag
from stagerd.sinks.hub.fetch import _revision, restore_hub_export
from stagerd.sinks.hub.url import parse_hub_url
from tests.sinks.hub.hub_helpers import (  # noqa: F401  (fixtures)
    REPO,
    default_hub_config,
    export_files,
    lfs_only,
    make_sink,
    write_export,
)
from tests.sinks.hub.hub_helpers import one_file_export as export


def test_two_revisions_publish_the_same_step_each_its_own(hub, tmp_path, monkeypatch):
    """Before, the tag `step-5` was repo-wide: run B found run A's tag, took step 5 for published
    (`is_published` True: the fleet skipped it, a silent loss), and `publish` raised "the Hub already holds
    step 5" for ever."""
    main, a, b = make_sink(hub), make_sink(hub, f"hf://{REPO}@exp-a"), make_sink(hub, f"hf://{REPO}@exp-b")
    main.publish(export(tmp_path, 1), 5)

    assert not a.is_published(5) and not b.is_published(5)
    ra = a.publish(export(tmp_path, 2), 5)
    rb = b.publish(export(tmp_path, 3), 5)

    assert not ra.skipped and not rb.skipped and hub.stats.commits[REPO] == 3
    assert main.is_published(5) and a.is_published(5) and b.is_published(5)
    assert not b.is_published(6)
    repo = hub.store.repos[REPO]
    assert set(repo.tags) == {"step-5", "exp-a/step-5", "exp-b/step-5"}
    for rev, tag in (("exp-a", "exp-a/step-5"), ("exp-b", "exp-b/step-5")):
        assert repo.tags[tag] == repo.branches[rev]
        assert repo.commits[repo.tags[tag]].title == f"stagerd: step 5 on {rev}"
    assert b.publish(export(tmp_path, 3), 5).skipped  # a rerun finds its own step
    monkeypatch.setenv("HF_TOKEN", hub.token)
    for url, seed in ((f"hf://{REPO}@exp-b", 3), (f"hf://{REPO}", 1), (f"hf://{REPO}@exp-a/step-5", 2)):
        out = restore_hub_export(f"{url}?endpoint={hub.endpoint}", tmp_path / f"out-{seed}", 5)
        got = export_files(out)
        assert {k: v for k, v in got.items() if k != "README.md"} == export_files(export(tmp_path, seed))


def test_a_revision_made_from_main_starts_with_no_steps_of_its_own(hub, tmp_path):
    """`@exp-b` is created from main, whose history holds main's steps. Before, exp-b's sink read main's
    `stagerd: step 9` as its own newest step, so its steps 1-9 went to `stagerd/step-N` branches (main's), and
    main's untagged step-5 commit (a crash before its tag) was taken and tagged as exp-b's step 5."""
    main = make_sink(hub)
    main.publish(export(tmp_path, 1), 5)
    del hub.store.repos[REPO].tags["step-5"]  # main's sink crashed between its commit and its tag
    main.publish(export(tmp_path, 2), 9)
    b = make_sink(hub, f"hf://{REPO}@exp-b")

    result = b.publish(export(tmp_path, 3), 5)

    repo = hub.store.repos[REPO]
    assert not result.skipped and hub.stats.commits[REPO] == 3
    assert repo.commits[repo.branches["exp-b"]].title == "stagerd: step 5 on exp-b"
    assert repo.tags["exp-b/step-5"] == repo.branches["exp-b"] and "step-5" not in repo.tags
    assert "stagerd/step-5" not in repo.branches
    assert main.publish(export(tmp_path, 1), 5).skipped  # main's own crash recovery still tags its commit
    assert repo.commits[repo.tags["step-5"]].title == "stagerd: step 5"


def test_branch_per_step_on_two_revisions(hub, tmp_path):
    """Before, both sinks used the branch `stagerd/step-7`: the second found the first's commit there and
    took it for its own (a conflict, or the other run's weights tagged as its step)."""
    a = make_sink(hub, f"hf://{REPO}@exp-a", branch_per_step=True)
    b = make_sink(hub, f"hf://{REPO}@exp-b", branch_per_step=True)
    a.publish(export(tmp_path, 1), 7)

    assert not b.publish(export(tmp_path, 2), 7).skipped

    repo = hub.store.repos[REPO]
    assert {"stagerd/exp-a/step-7", "stagerd/exp-b/step-7"} <= set(repo.branches)
    assert repo.tags["exp-b/step-7"] == repo.branches["stagerd/exp-b/step-7"]
    assert a.is_published(7) and b.is_published(7) and a.publish(export(tmp_path, 1), 7).skipped


@pytest.mark.parametrize("target", ["other branch", "not a step commit"])
def test_a_tag_that_marks_another_commit_is_not_published(hub, tmp_path, target):
    """The tag `step-4` exists, but marks a commit of another branch (an older stagerd published exp-b's step
    4 under the repo-wide tag) or a commit that is no step (a person's tag). Before, `is_published` said True
    and `publish` of the same files returned "already published": step 4 never reached main."""
    data = export(tmp_path, 1)
    make_sink(hub, f"hf://{REPO}@exp-b").publish(data, 4)
    repo = hub.store.repos[REPO]
    initial = repo.history(repo.commits[repo.branches["main"]])[-1].oid
    commit = repo.branches["exp-b"] if target == "other branch" else initial
    with hub.store.lock:
        repo.tags["step-4"] = commit
    sink = make_sink(hub)

    assert not sink.is_published(4)
    with pytest.raises(SinkConflictError) as info:
        sink.publish(data, 4)

    err = info.value
    assert err.path == f"hf://{REPO}" and f"the tag step-4 marks commit {commit}" in str(err)
    assert f"marks commit {commit} (Hub account {hub.user}, 20" in str(err)  # who made it, and when
    assert "step-4" in err.hint and not err.retryable
    assert hub.stats.commits[REPO] == 1 and repo.tags["step-4"] == commit


def test_names_are_scoped_to_the_revision():
    assert step_tag(3) == step_tag(3, "main") == "step-3" and step_tag(3, "exp/a") == "exp/a/step-3"
    assert step_branch(3, "main") == "stagerd/step-3" and step_branch(3, "exp-a") == "stagerd/exp-a/step-3"
    assert commit_message(3) == "stagerd: step 3" and commit_message(3, "exp-a") == "stagerd: step 3 on exp-a"
    commits = [
        ("d", "stagerd: step 9 on exp"),
        ("c", "edit"),
        ("b", "stagerd: step 8"),
        ("a", "stagerd: step 5"),
    ]
    assert scan_history(iter(commits), 9, revision="exp")[:2] == (9, "d")
    assert scan_history(iter(commits), 5, revision="exp")[:2] == (9, None)  # main's step 5 is not exp's
    assert scan_history(iter(commits[2:]), 5, revision="exp")[:2] == (None, None)
    assert scan_history(iter(commits), 5)[:2] == (None, None)  # exp's commit on top: where main's own ends
    assert scan_history(iter(commits[1:]), 5)[:2] == (8, "a")
    assert _revision(None, 4) == "step-4" and _revision("exp-a", 4) == "exp-a/step-4"
    assert _revision("step-4", 4) == "step-4" and _revision("exp-a/step-4", 4) == "exp-a/step-4"
    assert _revision("exp-a", None) == "exp-a" and _revision(None, None) == "main"
    for bad in ("step-3", "exp-a/step-3"):
        with pytest.raises(ConfigError):
            _revision(bad, 4)


def test_the_card_of_a_step_off_main_names_its_own_tag(hub, tmp_path, monkeypatch):
    """The README.md published with a step tells how to load it. Before, a step of `@exp-a` said the tag
    `step-5` marks it and loaded `revision="step-5"`: main's step 5, other weights (or no such tag)."""
    make_sink(hub, f"hf://{REPO}@exp-a").publish(export(tmp_path, 2), 5)
    monkeypatch.setenv("HF_TOKEN", hub.token)
    out = restore_hub_export(f"hf://{REPO}@exp-a?endpoint={hub.endpoint}", tmp_path / "out", 5)
    card = (out / "README.md").read_text()
    assert 'revision="exp-a/step-5"' in card and "The tag `exp-a/step-5` marks this commit." in card
    assert '"step-5"' not in card and "`step-5`" not in card


def test_a_revision_git_cannot_name_is_a_config_error_before_anything_is_written(hub, tmp_path):
    """Before, `hf://ORG/REPO@my branch` created the repo and the branch and committed the step, then every
    try failed to tag it (`my branch/step-1`: 400) as a retryable error; the Hub refuses such a branch too."""
    for rev in ("my branch", "a..b", "x.lock", "a@{b", "a//b", "x~1", "a:b", ".x", "a/.b", "x."):
        with pytest.raises(ConfigError, match="not a valid branch name") as info:
            make_sink(hub, f"hf://{REPO}@{rev}")
        assert repr(rev) in str(info.value) and "?" not in str(info.value)
    assert REPO not in hub.store.repos and not hub.stats.count("*", "")
    for rev in ("exp/run-1", "v1.0", "-x", "release_2"):
        assert parse_hub_url(f"hf://{REPO}@{rev}").revision == rev
    api = HfApi(endpoint=hub.endpoint, token=hub.token)
    api.create_repo(REPO)
    with pytest.raises(HfHubHTTPError, match="invalid branch name"):
        api.create_branch(REPO, branch="my branch")
    api.create_branch(REPO, branch="exp")
    with pytest.raises(HfHubHTTPError, match="conflicts with the existing branch exp"):
        api.create_branch(REPO, branch="exp/a")
    assert {b.name for b in api.list_repo_refs(REPO).branches} == {"main", "exp"}


def test_a_restore_of_a_branch_reads_one_commit_while_a_step_lands(hub, tmp_path, monkeypatch):
    """Before, each file was downloaded at the branch's head of that moment: a step published to main
    during a restore of main failed it on the next file (its tree listed the step before)."""
    sink = make_sink(hub)
    first = write_export(tmp_path / "a", seed=1, shards=2)
    sink.publish(first, 5)
    monkeypatch.setenv("HF_TOKEN", hub.token)

    def land_step_6(done: int, total: int) -> None:
        if hub.stats.commits[REPO] == 1:
            sink.publish(write_export(tmp_path / "b", seed=2, shards=2), 6)

    out = restore_hub_export(
        f"hf://{REPO}?endpoint={hub.endpoint}", tmp_path / "out", None, progress=land_step_6
    )

    assert hub.stats.commits[REPO] == 2
    assert {k: v for k, v in export_files(out).items() if k != "README.md"} == export_files(first)
    assert "step **5**" in (out / "README.md").read_text()


def test_a_restore_takes_the_token_the_sink_url_names(hub, tmp_path, monkeypatch):
    """`?token=` publishes to a private repo; before, restore of that same URL ignored it and answered
    "not found" (the Hub hides a private repo from anonymous readers)."""
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")
    url = f"hf://{REPO}@exp-a?endpoint={hub.endpoint}&token={hub.read_token}"
    make_sink(hub, url).publish(export(tmp_path, 2), 5)

    out = restore_hub_export(url, tmp_path / "out", 5)

    assert {k: v for k, v in export_files(out).items() if k != "README.md"} == export_files(
        export(tmp_path, 2)
    )
    with pytest.raises(RestoreError, match="not found") as info:
        restore_hub_export(url.split("&")[0], tmp_path / "out-2", 5)
    assert "HF_TOKEN" in info.value.hint and "private" in info.value.hint


def test_a_tag_set_by_someone_else_during_the_upload_is_a_conflict(hub, tmp_path):
    """A person (or an older stagerd's repo-wide tag) sets `step-4` on another commit while the step
    uploads. Before, the sink's tag call took the Hub's "already exists" for its own tag: the publish
    reported step 4 published, and `restore --step 4` read that other commit."""
    make_sink(hub).publish(export(tmp_path, 1), 3)
    repo = hub.store.repos[REPO]
    other = repo.branches["main"]

    def tag_by_hand() -> None:
        with hub.store.lock:
            repo.tags["step-4"] = other

    hub.on_lfs_body(1, tag_by_hand)
    with pytest.raises(SinkConflictError, match=f"the tag step-4 marks commit {other}"):
        make_sink(hub).publish(export(tmp_path, 2), 4)
    assert repo.tags["step-4"] == other and repo.commits[repo.branches["main"]].title == "stagerd: step 4"


def test_a_step_branch_someone_else_made_is_a_conflict_not_overwritten(hub, tmp_path):
    """Main holds step 5; a person made `stagerd/step-4` by hand and committed a file of their own on it.
    Before, the sink committed step 4 on top of that branch, deleting the person's file from its head."""
    sink = make_sink(hub)
    sink.publish(export(tmp_path, 5), 5)
    api = HfApi(endpoint=hub.endpoint, token=hub.token)
    api.create_branch(REPO, branch="stagerd/step-4")
    api.create_commit(
        REPO, [CommitOperationAdd("mine.bin", b"x")], commit_message="mine", revision="stagerd/step-4"
    )
    repo = hub.store.repos[REPO]
    head = repo.branches["stagerd/step-4"]

    with pytest.raises(SinkConflictError, match="stagerd/step-4 holds commits that are not on main") as info:
        sink.publish(export(tmp_path, 4), 4)
    assert "stagerd/step-4" in info.value.hint and not info.value.retryable
    assert repo.branches["stagerd/step-4"] == head and "step-4" not in repo.tags

    api.create_branch(REPO, branch="stagerd/step-3")  # made from main, nothing on it: a sink's own leftover
    assert not sink.publish(export(tmp_path, 3), 3).skipped and sink.is_published(3)
