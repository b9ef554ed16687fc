"""A repo whose `.gitignore` matches files of a step: the Hub answers `shouldIgnore` for them and
huggingface_hub would leave them out of the commit, so the sink refuses the step before anything is sent,
through Xet and through LFS alike. A `.gitignore` that matches nothing of the export changes nothing."""

from __future__ import annotations

import pytest
from huggingface_hub import CommitOperationAdd, HfApi

from stagerd.errors import IgnoredFilesError
from stagerd.sinks.hub import step_tag
from tests.hubserver import HubServer
from tests.sinks.hub.hub_helpers import REPO, make_sink, one_file_export


@pytest.fixture(params=[True, False], ids=["xet", "lfs"])
def xet(request: pytest.FixtureRequest) -> bool:
    return request.param


def person_commits_gitignore(hub: HubServer, rules: str) -> HfApi:
    api = HfApi(endpoint=hub.endpoint, token=hub.token)
    api.create_repo(REPO, exist_ok=True)
    api.create_commit(
        REPO,
        [CommitOperationAdd(".gitignore", rules.encode())],
        commit_message="a template's .gitignore",
    )
    return api


def test_a_gitignore_matching_export_files_refuses_the_step_before_anything_is_sent(hub, tmp_path):
    api = person_commits_gitignore(hub, "# weights live elsewhere\n*.safetensors\n/README.md\n")
    head = api.list_repo_refs(REPO).branches[0].target_commit
    preuploads = hub.stats.count("POST", r"/preupload/")

    with pytest.raises(IgnoredFilesError) as e:
        make_sink(hub).publish(one_file_export(tmp_path, 1), 1)

    assert not e.value.retryable
    message = str(e.value)
    assert "\n" not in message and "branch main" in message, message
    assert "model.safetensors" in message and "README.md" in message and "config.json" not in message
    assert "remove the rule" in e.value.hint
    refs = api.list_repo_refs(REPO)
    assert not refs.tags and [b.target_commit for b in refs.branches] == [head]  # nothing committed
    assert hub.stats.commits[REPO] == 1  # the person's .gitignore only
    assert hub.stats.bytes_received == 0 and not hub.stats.xet_tokens  # nothing uploaded
    assert hub.stats.count("POST", r"/preupload/") == preuploads + 1  # every file asked in one request


def test_a_gitignore_matching_nothing_of_a_step_changes_nothing_and_one_that_does_stops_the_next(
    hub, tmp_path
):
    # git's rules, not a glob's: negated, anchored to a folder, or a folder's contents only
    api = person_commits_gitignore(
        hub, "*.bin\ncheckpoint-*/\n*.safetensors\n!model.safetensors\ndocs/README.md\n"
    )
    preuploads = hub.stats.count("POST", r"/preupload/")

    result = make_sink(hub).publish(one_file_export(tmp_path, 1), 1)

    assert not result.skipped and hub.stats.commits[REPO] == 2
    assert set(hub.stats.commit_adds[-1]) == {"model.safetensors", "config.json", "README.md"}
    assert hub.stats.count("POST", r"/preupload/") == preuploads + 1  # not asked again by create_commit
    tree = {f.path for f in api.list_repo_tree(REPO, revision=step_tag(1))}
    # the step's files, and the person's .gitignore left as it is
    assert tree == {".gitattributes", "model.safetensors", "config.json", "README.md", ".gitignore"}
    person_commits_gitignore(hub, "config.json\n")  # the person changes it

    with pytest.raises(IgnoredFilesError, match=r"branch main matches config\.json, which"):
        make_sink(hub).publish(one_file_export(tmp_path, 2), 2)

    assert [t.name for t in api.list_repo_refs(REPO).tags] == [step_tag(1)] and hub.stats.commits[REPO] == 3
