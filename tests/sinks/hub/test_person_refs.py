"""A person's refs and commits in the sink's repo: a revision in the URL that is a tag or a commit id, a
step branch a person makes while the sink is about to make it, a commit a person makes while a step
uploads. The sink never writes onto, beside or over a person's ref, and never loses a person's commit.

Against the Hub-protocol test server, driven by the real huggingface_hub client."""

from __future__ import annotations

from pathlib import Path

import pytest
from huggingface_hub import HfApi

from stagerd.errors import ConfigError, SinkConflictError
from stagerd.sinks.hub import step_branch
from stagerd.sinks.hub.fetch import restore_hub_export
from tests.hubserver import Fault
from tests.hubserver.store import Blob
from tests.sinks.hub.hub_helpers import (  # noqa: F401  (fixtures)
    REPO,
    default_hub_config,
    export_files,
    lfs_only,
    make_sink,
)
from tests.sinks.hub.hub_helpers import one_file_export as export


def refs(hub) -> tuple[dict[str, str], dict[str, str]]:
    repo = hub.store.repos[REPO]
    return dict(repo.branches), dict(repo.tags)


@pytest.mark.parametrize("tag", ["v1", "step-5"])
def test_a_revision_that_names_a_tag_is_refused_before_anything_is_written(hub, tmp_path, tag):
    """`hf://ORG/REPO@step-5` (the form `restore` reads) or `@v1` (a person's release tag) given to a
    publisher. Before, the sink made a branch of that name beside the tag, from main, and committed its
    steps there: on the Hub a branch wins over a tag of the same name, so `restore @step-5` (and anyone's
    `from_pretrained(revision="v1")`) then read the sink's newest step instead of the tagged commit."""
    make_sink(hub).publish(export(tmp_path, 1), 5)
    api = HfApi(endpoint=hub.endpoint, token=hub.token)
    if tag == "v1":
        api.create_tag(REPO, tag="v1")
    before, commits = refs(hub), hub.stats.commits[REPO]

    sink = make_sink(hub, f"hf://{REPO}@{tag}")
    with pytest.raises(SinkConflictError, match=f"{tag} is a tag of {REPO}, not a branch") as info:
        sink.publish(export(tmp_path, 2), 6)
    assert not info.value.retryable and "branch" in info.value.hint
    assert not sink.is_published(6)
    assert refs(hub) == before and hub.stats.commits[REPO] == commits


def test_a_tag_nested_with_the_steps_tag_is_refused_before_the_commit(hub, tmp_path):
    """A person's tag `step-6/rc1`: git keeps refs as paths, so the tag `step-6` cannot be made beside it.
    Before, step 6 was committed onto main and its tag then refused (400): main moved to an untagged step
    that every rerun committed nothing for and failed to tag again."""
    make_sink(hub).publish(export(tmp_path, 1), 5)
    HfApi(endpoint=hub.endpoint, token=hub.token).create_tag(REPO, tag="step-6/rc1")
    before, commits = refs(hub), hub.stats.commits[REPO]
    with pytest.raises(
        SinkConflictError, match="the tag step-6/rc1 of acme/llm keeps the step's tag"
    ) as info:
        make_sink(hub).publish(export(tmp_path, 2), 6)
    assert "rename the tag step-6/rc1" in info.value.hint
    assert refs(hub) == before and hub.stats.commits[REPO] == commits


def test_a_branch_named_as_the_steps_tag_is_refused_before_anything_is_written(hub, tmp_path):
    """A person's branch `step-6` (or another run's `hf://ORG/REPO@step-6` before it tagged a step): on the
    Hub a branch wins over a tag of the same name, so the tag `step-6` made beside it would send
    `restore --step 6` and `from_pretrained(revision="step-6")` to the branch. Before, it was made."""
    make_sink(hub).publish(export(tmp_path, 1), 5)
    HfApi(endpoint=hub.endpoint, token=hub.token).create_branch(REPO, branch="step-6")
    before, commits = refs(hub), hub.stats.commits[REPO]

    with pytest.raises(
        SinkConflictError, match="the branch step-6 of acme/llm has the name of the step's tag"
    ) as info:
        make_sink(hub).publish(export(tmp_path, 2), 6)
    assert not info.value.retryable and "rename the branch step-6" in info.value.hint
    assert refs(hub) == before and hub.stats.commits[REPO] == commits


def test_a_restore_reads_the_steps_tag_not_a_branch_of_its_name(hub, tmp_path):
    """A person makes the branch `step-6` after step 6 was tagged: the Hub reads the name as the branch.
    Before, `restore --step 6` landed the branch's files (step 5's here) as step 6, every check passing."""
    make_sink(hub).publish(export(tmp_path, 1), 5)
    make_sink(hub).publish(export(tmp_path, 2), 6)
    HfApi(endpoint=hub.endpoint, token=hub.token).create_branch(
        REPO, branch="step-6", revision=hub.store.repos[REPO].tags["step-5"]
    )

    out = restore_hub_export(f"hf://{REPO}?endpoint={hub.endpoint}&token={hub.token}", tmp_path / "out", 6)

    step6 = export_files(Path(tmp_path / "export-2"))
    assert {rel: data for rel, data in export_files(out).items() if rel in step6} == step6


@pytest.mark.parametrize("what", ["a commit id", "a full ref name"])
def test_a_revision_that_is_a_commit_id_or_a_full_ref_is_a_config_error(hub, tmp_path, what):
    """`@<40 hex>` names a commit, `@refs/pr/1` a pull request's ref: neither is a branch. Before, the sink
    made a branch of that name from main (which then shadows the commit for every reader of the id) and
    committed its steps onto it."""
    make_sink(hub).publish(export(tmp_path, 1), 5)
    oid = hub.store.repos[REPO].branches["main"]
    revision = oid if what == "a commit id" else "refs/pr/1"
    before = refs(hub)
    with pytest.raises(ConfigError, match=f"is {what}, not a branch") as info:
        make_sink(hub, f"hf://{REPO}@{revision}")
    assert "branch" in info.value.hint
    assert refs(hub) == before


def test_a_step_branch_a_person_makes_meanwhile_is_a_conflict_not_committed_onto(hub, tmp_path):
    """Main holds step 5, so step 4 goes to `stagerd/step-4`, absent when the sink read the refs. A person
    makes that branch, with a commit of their own, before the sink's `create_branch` lands (the Hub then
    answers 409). Before, `exist_ok=True` took the 409 for the sink's own branch: step 4 was committed on
    top of the person's commit, deleting their file from the branch's head."""
    sink = make_sink(hub)
    sink.publish(export(tmp_path, 5), 5)
    repo = hub.store.repos[REPO]
    branch = step_branch(4)

    def person_makes_it() -> bool:
        with hub.store.lock:
            if branch not in repo.branches:
                repo.branches[branch] = repo.branches["main"]
                tree = {**repo.commits[repo.branches[branch]].tree, "mine.bin": Blob.regular(b"mine")}
                hub.store.commit(repo, branch, "mine", "", "person", tree)
        return True

    conflict = '{"error": "Reference already exists: refs/heads/stagerd/step-4"}'
    hub.faults.add(Fault("POST", r"/branch/stagerd", status=409, body=conflict, not_before=person_makes_it))
    head_before = None
    with pytest.raises(
        SinkConflictError, match=f"the branch {branch} holds commits that are not on main"
    ) as e:
        head_before = repo.branches.get(branch)
        sink.publish(export(tmp_path, 4), 4)
    head = repo.branches[branch]
    assert f"; its head {head} is by Hub account person, 20" in str(e.value)  # who made it, and when
    assert head_before is None and repo.commits[head].title == "mine"
    assert "mine.bin" in repo.commits[head].tree and "step-4" not in repo.tags


def test_a_persons_commit_during_the_upload_is_kept_in_the_history(hub, tmp_path):
    """A person commits to main while step 6 uploads: notes of their own, and weights a loader would read in
    place of the export's. The step's commit names its parent, so the Hub refuses it (412) and the step is
    planned again on the person's commit: it stays in main's history, under the step; their notes stay (a
    step's commit deletes only what stagerd wrote, and weights), the weights go. Without `parent_commit`
    the commit lands on the person's head, planned without it, and leaves their weights in the step."""
    make_sink(hub).publish(export(tmp_path, 1), 5)
    repo = hub.store.repos[REPO]
    mine: list[str] = []

    def person_commits() -> None:
        tree = {
            **repo.commits[repo.branches["main"]].tree,
            "notes.md": Blob.regular(b"# mine\n"),
            "pytorch_model.bin": Blob.regular(b"older weights"),
        }
        mine.append(hub.store.commit(repo, "main", "notes", "", "person", tree).oid)

    hub.on_lfs_body(1, person_commits)
    result = make_sink(hub).publish(export(tmp_path, 2), 6)

    step = repo.commits[repo.tags["step-6"]]
    assert not result.skipped and repo.branches["main"] == step.oid
    assert step.parent == mine[0] and repo.commits[mine[0]].title == "notes"
    assert step.tree["notes.md"] == repo.commits[mine[0]].tree["notes.md"]
    assert "pytorch_model.bin" in repo.commits[mine[0]].tree and "pytorch_model.bin" not in step.tree
