"""`stagerd restore hf://ORG/REPO@step-N OUT --export`, the step named in the URL as README offers beside
`--step N`, reads the step's tag even where a branch has its name (the Hub reads such a name as the branch).

Before, only `--step N` on a URL without it read the tag from the refs: `@step-5` (with or without
`--step 5`) asked the Hub for the name, got a person's branch `step-5` (made after the tag,
from main), and restored step 6's weights as step 5, checked against that branch's tree and so with no error.
"""

from __future__ import annotations

import pytest
from huggingface_hub import HfApi

from stagerd.errors import RestoreError
from stagerd.sinks.hub.fetch import restore_hub_export
from tests.sinks.hub.hub_helpers import REPO, export_files, make_sink, one_file_export


def weights(out) -> dict[str, bytes]:
    return {rel: data for rel, data in export_files(out).items() if rel != "README.md"}


@pytest.mark.parametrize("step", [None, 5])
def test_a_step_named_in_the_url_is_read_from_its_tag_not_a_branch_of_its_name(hub, tmp_path, step):
    sink = make_sink(hub)
    sink.publish(one_file_export(tmp_path, 5), 5)
    sink.publish(one_file_export(tmp_path, 6), 6)
    HfApi(endpoint=hub.endpoint, token=hub.token).create_branch(REPO, branch="step-5")  # from main: step 6

    out = restore_hub_export(
        f"hf://{REPO}@step-5?endpoint={hub.endpoint}&token={hub.token}", tmp_path / "o", step
    )

    assert weights(out) == export_files(tmp_path / "export-5")


def test_a_step_url_without_such_a_tag_reads_the_revision_and_with_step_is_never_published(hub, tmp_path):
    make_sink(hub).publish(one_file_export(tmp_path, 5), 5)
    HfApi(endpoint=hub.endpoint, token=hub.token).create_branch(REPO, branch="step-7")
    url = f"hf://{REPO}@step-7?endpoint={hub.endpoint}&token={hub.token}"

    assert weights(restore_hub_export(url, tmp_path / "branch", None)) == export_files(tmp_path / "export-5")
    with pytest.raises(RestoreError, match="never published"):
        restore_hub_export(url, tmp_path / "step", 7)


def test_a_step_published_on_another_branch_is_named_in_the_hint(hub, tmp_path):
    """`--step 4` of a step published with `@dev` (tag `dev/step-4`): not on main, and the hint says where."""
    make_sink(hub, f"hf://{REPO}@dev").publish(one_file_export(tmp_path, 4), 4)

    with pytest.raises(RestoreError, match="never published") as info:
        restore_hub_export(f"hf://{REPO}?endpoint={hub.endpoint}&token={hub.token}", tmp_path / "o", 4)

    assert info.value.hint == f"step 4 was published on dev: restore hf://{REPO}@dev --step 4"
    assert not (tmp_path / "o").exists()
