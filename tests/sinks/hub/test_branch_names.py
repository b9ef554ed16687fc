"""A person's branch whose name leaves no room for a branch the sink must make (`stagerd` beside
`stagerd/step-N`, `a` beside the revision `a/b`): git keeps refs as paths, so the Hub refuses the new
branch with a bare 400. Before, that 400 came after the revision's branch was made, unnamed and retried;
now it is a named error, not retried, before anything is written, and the steps that need no such branch
publish on. Against the Hub-protocol test server, driven by the real huggingface_hub client."""

from __future__ import annotations

import pytest
from huggingface_hub import HfApi

from stagerd.errors import SinkConflictError
from tests.sinks.hub.hub_helpers import REPO, default_hub_config, lfs_only, make_sink  # noqa: F401  (fixtures)
from tests.sinks.hub.hub_helpers import one_file_export as export


def _refs(hub) -> tuple[dict[str, str], dict[str, str], int]:
    repo = hub.store.repos[REPO]
    return dict(repo.branches), dict(repo.tags), hub.stats.commits[REPO]


def test_a_branch_named_stagerd_is_a_named_error_before_any_write(hub, tmp_path):
    make_sink(hub).publish(export(tmp_path, 1), 5)
    HfApi(endpoint=hub.endpoint, token=hub.token).create_branch(REPO, branch="stagerd")
    before = _refs(hub)
    sink = make_sink(hub, branch_per_step=True)
    with pytest.raises(
        SinkConflictError, match=r"the branch stagerd of .* keeps the branch stagerd/step-6"
    ) as info:
        sink.publish(export(tmp_path, 2), 6)
    assert not info.value.retryable and "rename the branch stagerd" in info.value.hint
    assert "branch_per_step" in info.value.hint
    assert _refs(hub) == before
    # steps in order need no step branch: a sink without branch_per_step goes on
    make_sink(hub).publish(export(tmp_path, 3), 7)
    assert make_sink(hub).is_published(7)
    # a step older than the revision's newest needs one: named, and nothing written
    before = _refs(hub)
    with pytest.raises(SinkConflictError, match="keeps the branch stagerd/step-6"):
        make_sink(hub).publish(export(tmp_path, 2), 6)
    assert _refs(hub) == before


def test_a_branch_that_is_a_folder_of_the_revision_is_a_named_error_before_any_write(hub, tmp_path):
    make_sink(hub).publish(export(tmp_path, 1), 5)
    HfApi(endpoint=hub.endpoint, token=hub.token).create_branch(REPO, branch="exp")
    before = _refs(hub)
    with pytest.raises(SinkConflictError, match=r"the branch exp of .* keeps the branch exp/a") as info:
        make_sink(hub, f"hf://{REPO}@exp/a").publish(export(tmp_path, 2), 6)
    assert not info.value.retryable and "another revision" in info.value.hint
    assert _refs(hub) == before
