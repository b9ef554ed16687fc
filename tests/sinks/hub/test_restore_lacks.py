"""A Hub restore of a step or revision the repo lacks names the steps its tags show, in the words of an S3 or
file:// restore (`the sink holds N exported step(s): ...`), with the `--step` or URL to give; a gated repo
is a `SinkAuthError`, not "no such repo".

Before, it said only that the step was never published (with a hint naming no step), an empty `main` of a
repo whose steps were published `@dev` said "holds no files", and a gated repo (huggingface_hub's
`GatedRepoError` is a `RepositoryNotFoundError`) was "not found".
"""

from __future__ import annotations

import pytest

from stagerd.errors import RestoreError, SinkAuthError
from stagerd.sinks.hub.fetch import restore_hub_export
from tests.hubserver import Fault
from tests.sinks.hub.hub_helpers import REPO, lfs_only, make_sink, one_file_export  # noqa: F401  (fixtures)


def url_of(hub, revision: str = "") -> str:
    return f"hf://{REPO}{revision}?endpoint={hub.endpoint}&token={hub.token}"


def lacking(hub, tmp_path, revision: str, step: int | None) -> RestoreError:
    with pytest.raises(RestoreError) as info:
        restore_hub_export(url_of(hub, revision), tmp_path / "out", step)
    assert not (tmp_path / "out").exists() and hub.token not in f"{info.value} {info.value.hint}"
    return info.value


def test_a_step_or_revision_the_repo_lacks_names_the_steps_it_holds(hub, tmp_path):
    main = make_sink(hub)
    for n in (3, 5):
        main.publish(one_file_export(tmp_path, n), n)
    make_sink(hub, f"hf://{REPO}@dev").publish(one_file_export(tmp_path, 9), 9)

    e = lacking(hub, tmp_path, "", 4)
    assert e.message == (
        "the repo has no revision step-4: that step was never published to it; "
        "the sink holds 2 exported step(s): 5, 3 (newest first)"
    )
    assert e.hint == "nothing was restored; give one of them with --step N (`--step 5`: the newest)"

    e = lacking(hub, tmp_path, "@dev", 3)  # dev's own steps are named, and where step 3 is
    assert "the sink holds 1 exported step(s): 9 (newest first)" in e.message
    assert e.hint == f"step 3 was published on main: restore hf://{REPO}@main --step 3"

    e = lacking(hub, tmp_path, "@nobranch", None)
    assert e.message == (
        "the repo has no revision nobranch: no step was published to it; "
        "the repo holds exported steps on main, dev only"
    )
    assert f"hf://{REPO}@main --step 5 (its newest)" in e.hint


def test_an_empty_main_of_a_repo_published_at_a_branch_names_that_branch(hub, tmp_path):
    make_sink(hub, f"hf://{REPO}@dev").publish(one_file_export(tmp_path, 9), 9)

    e = lacking(hub, tmp_path, "", None)

    assert e.message == (
        "holds no files: no step was published to it; the repo holds exported steps on dev only"
    )
    assert f"hf://{REPO}@dev --step 9 (its newest)" in e.hint


def test_a_gated_repo_is_an_auth_error_not_a_missing_repo(hub, tmp_path):
    make_sink(hub).publish(one_file_export(tmp_path, 1), 1)
    # beside it, as they were: no such repo, and a token the Hub refuses (given in the URL, never shown)
    refused = "hf_" + "9" * 32
    for url, error, said in [
        (url_of(hub).replace(REPO, f"{REPO}-none"), RestoreError, "no such repo"),
        (url_of(hub).replace(hub.token, refused), SinkAuthError, "the Hub refused the token (401)"),
    ]:
        with pytest.raises(error) as info:
            restore_hub_export(url, tmp_path / "out", None)
        shown = f"{info.value} {info.value.hint}"
        assert said in info.value.message and "\n" not in shown and info.value.hint, shown
        assert hub.token not in shown and refused not in shown
    hub.faults.add(Fault("GET", f"/api/models/{REPO}/", status=403, headers={"X-Error-Code": "GatedRepo"}))

    with pytest.raises(SinkAuthError) as info:
        restore_hub_export(url_of(hub), tmp_path / "out", None)

    e = info.value
    assert "gated" in e.message and "403" in e.message and "\n" not in e.message, e.message
    assert "request access" in e.hint and "HF_TOKEN" in e.hint
    assert hub.token not in f"{e} {e.hint}" and not e.retryable and not (tmp_path / "out").exists()
