"""A step's commit beyond the history the sink reads (a long run's old step), and steps an older stagerd
published off main under unscoped names (`stagerd: step N`, tag `step-N`), after the upgrade.

Against the Hub-protocol test server, driven by the real huggingface_hub client."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from stagerd.errors import RestoreError, SinkConflictError
from stagerd.sinks.hub import _HISTORY_CAP, above_fork, commit_message
from stagerd.sinks.hub.fetch import restore_hub_export
from stagerd.sinks.hub.history import find_step, tag_title_is_ours
from tests.hubserver import HubServer
from tests.sinks.hub.hub_helpers import (  # noqa: F401  (fixtures)
    REPO,
    default_hub_config,
    export_files,
    lfs_only,
    make_sink,
)
from tests.sinks.hub.hub_helpers import one_file_export as export
from tests.sinks.hub.test_hang import grow_history


def test_a_step_older_than_the_history_cap_is_still_published(hub, tmp_path):
    """A long run: step 1, then more than `_HISTORY_CAP` later steps on main. Before, the walk ended at the
    cap without step 1's commit: `is_published(1)` was False (the fleet, retention and verify took a
    published step for unpublished) and its re-publish raised `SinkConflictError` on its own tag."""
    data = export(tmp_path, 1)
    sink = make_sink(hub)
    sink.publish(data, 1)
    grow_history(hub, range(2, _HISTORY_CAP + 10))
    repo = hub.store.repos[REPO]
    commits = len(repo.commits)

    assert sink.is_published(1)
    assert sink.publish(data, 1).skipped and len(repo.commits) == commits

    with hub.store.lock:  # the tag moved to another step's commit: beyond the cap, still not this step's
        repo.tags["step-1"] = repo.tags["step-2"]
    assert not sink.is_published(1)
    with pytest.raises(SinkConflictError, match="the tag step-1 marks commit"):
        sink.publish(data, 1)
    assert len(repo.commits) == commits


def old_stagerd_step(hub: HubServer, revision: str, step: int, *, tagged: bool) -> str:
    """Rename the step a sink on `revision` just published as an older stagerd named it: the title
    `stagerd: step N` and the tag `step-N` (or none: a crash between its commit and its tag)."""
    repo = hub.store.repos[REPO]
    with hub.store.lock:
        oid = repo.tags.pop(f"{revision}/step-{step}")
        repo.commits[oid] = dataclasses.replace(repo.commits[oid], title=commit_message(step))
        if tagged:
            repo.tags[f"step-{step}"] = oid
    return oid


def test_an_older_stagerds_steps_on_a_revision_stay_its_own(hub, tmp_path, monkeypatch):
    """`@exp` was made from main (main holds step 3); an older stagerd published exp's steps 5 and 6 as
    `stagerd: step N`, step 6 untagged (the daemon was upgraded between its commit and its tag). Before,
    the walk took those commits for main's: `is_published(5)` was False, step 4 (a slower worker) was
    committed onto exp over step 6's weights, step 6 got a second commit, and `restore @exp --step 5`
    found no tag `exp/step-5`."""
    main, exp = make_sink(hub), make_sink(hub, f"hf://{REPO}@exp")
    main.publish(export(tmp_path, 0), 3)
    exp.publish(export(tmp_path, 5), 5)
    five = old_stagerd_step(hub, "exp", 5, tagged=True)
    exp.publish(export(tmp_path, 6), 6)
    six = old_stagerd_step(hub, "exp", 6, tagged=False)
    repo = hub.store.repos[REPO]
    commits = len(repo.commits)

    assert exp.is_published(5) and not exp.is_published(6) and not exp.is_published(3)
    monkeypatch.setenv("HF_TOKEN", hub.token)
    url = f"hf://{REPO}@exp?endpoint={hub.endpoint}"
    got = export_files(restore_hub_export(url, tmp_path / "out", 5))
    assert {k: v for k, v in got.items() if k != "README.md"} == export_files(export(tmp_path, 5))
    with pytest.raises(RestoreError, match="exp/step-6"):  # untagged: never known to be complete
        restore_hub_export(url, tmp_path / "out-6", 6)
    assert not exp.publish(export(tmp_path, 4), 4).skipped
    assert repo.branches["exp"] == six and repo.tags["exp/step-4"] == repo.branches["stagerd/exp/step-4"]
    commits += 1
    assert exp.publish(export(tmp_path, 6), 6).skipped and len(repo.commits) == commits
    assert repo.tags["exp/step-6"] == six == repo.branches["exp"] and exp.is_published(6)
    assert exp.publish(export(tmp_path, 5), 5).skipped and repo.tags["exp/step-5"] == five
    assert main.is_published(3) and not main.is_published(5)  # exp's old tag step-5 is not main's


def test_an_unscoped_commit_is_the_revisions_only_above_where_it_left_every_other_branch(caplog):
    main = [("m3", "stagerd: step 3"), ("e", "edit"), ("root", "init")]
    exp = [("x6", "stagerd: step 6"), ("x5", "stagerd: step 5"), *main]
    assert above_fork(iter(exp), iter([("m4", "stagerd: step 4"), *main])) == {"x6", "x5"}
    assert above_fork(iter(main), iter(main)) == set()  # made from main's head: nothing of its own
    assert above_fork(iter(exp), iter([("sq", "Super-squash branch 'main'")])) is None
    assert above_fork(iter(exp), iter([("m9", "edit"), ("m8", "edit"), *main]), cap=2) is None

    def find(step, **more):
        hist = {"main": main, "exp": exp, "stagerd/exp/step-4": [("s4", "x"), *exp], **more}
        pages = lambda rev, n: iter(hist[rev])  # noqa: E731
        return find_step(pages, step, "exp", dict.fromkeys(hist, ""), cap=_HISTORY_CAP, page=50)

    assert find(5) == (6, "x5", False, True) and find(3)[:2] == (6, None)  # main's step 3 is not exp's
    assert not caplog.text
    with caplog.at_level(logging.WARNING, logger="stagerd.sinks.hub"):
        assert find(5, backup=exp[1:])[:2] == (6, None)  # a branch made from exp at step 5: not told apart
        assert "x5" in caplog.text and "backup" in caplog.text and "tag it exp/step-5" in caplog.text
        assert find(5, main=[("sq", "Super-squash")])[:2] == (None, None)  # nothing shows where exp left
    old4 = [("o4", "stagerd: step 4"), *exp]  # an older stagerd's step branch off exp, made at exp's step 6
    assert find(4, **{"stagerd/step-4": old4})[1:] == ("o4", False, True)
    assert find(4, **{"stagerd/step-4": [("o4", "stagerd: step 4"), *main]})[1] is None  # main's own


def test_a_tag_beyond_the_cap_counts_by_its_commits_title_on_the_revision():
    titles = {"c1": "stagerd: step 1 on exp", "c2": "stagerd: step 1", "c3": "stagerd: step 1 on other"}
    pages = lambda rev, n: iter([(rev, titles[rev])])  # noqa: E731
    assert tag_title_is_ours(pages, "c1", 1, "exp") and not tag_title_is_ours(pages, "c1", 2, "exp")
    assert tag_title_is_ours(pages, "c2", 1, "exp")  # exp's tag on an older stagerd's commit it took
    assert not tag_title_is_ours(pages, "c3", 1, "exp") and not tag_title_is_ours(pages, "c1", 1, "main")
    assert tag_title_is_ours(pages, "c2", 1, "main")


def test_a_commit_main_cannot_vouch_for_is_taken_as_mains_loudly(hub, tmp_path, caplog):
    """exp made from main at its step 1, then more than `_HISTORY_CAP` steps on main: whether exp's
    unscoped step-1 commit is main's cannot be read within the cap, so it is main's (exp's own steps start
    afresh on exp) and a warning names the commit and the tag to set if it is exp's."""
    make_sink(hub).publish(export(tmp_path, 1), 1)
    repo = hub.store.repos[REPO]
    with hub.store.lock:
        repo.branches["exp"] = repo.branches["main"]
    grow_history(hub, range(2, _HISTORY_CAP + 10), tag=False)

    with caplog.at_level(logging.WARNING, logger="stagerd.sinks.hub"):
        assert not make_sink(hub, f"hf://{REPO}@exp").publish(export(tmp_path, 1), 1).skipped

    assert repo.commits[repo.branches["exp"]].title == "stagerd: step 1 on exp"
    assert "tag it exp/step-1" in caplog.text


def test_an_older_stagerds_step_branch_of_a_revision_stays_its_own(hub, tmp_path):
    """An older stagerd put exp's step 4 (older than exp's head, step 6) on the step branch `stagerd/step-4`,
    the name main's step branches have. Before, a sink on exp looked only at `stagerd/exp/step-4`: step 4
    was not published and got a second commit. Main's own step branch of a step stays main's, and exp's
    stays exp's: before, main took it (and the older repo-wide tag `step-4` on it) for main's step 4."""
    main, exp = make_sink(hub), make_sink(hub, f"hf://{REPO}@exp")
    main.publish(export(tmp_path, 0), 3)
    exp.publish(export(tmp_path, 6), 6)
    six = old_stagerd_step(hub, "exp", 6, tagged=True)
    exp.publish(export(tmp_path, 4), 4)
    four = old_stagerd_step(hub, "exp", 4, tagged=True)
    repo = hub.store.repos[REPO]
    with hub.store.lock:  # the older stagerd's step branch name
        repo.branches["stagerd/step-4"] = repo.branches.pop("stagerd/exp/step-4")
    main.publish(export(tmp_path, 2), 2)  # main's own step branch `stagerd/step-2`, made from main at step 3
    commits = len(repo.commits)

    assert exp.is_published(4) and exp.is_published(6)
    assert not main.is_published(4)  # exp's, though on a branch of main's name and tagged `step-4`
    with pytest.raises(SinkConflictError, match=f"the tag step-4 marks commit {four}"):
        main.publish(export(tmp_path, 9), 4)
    assert main.is_published(2)
    assert exp.publish(export(tmp_path, 4), 4).skipped and len(repo.commits) == commits
    assert repo.tags["exp/step-4"] == four and repo.branches["exp"] == six
    assert not exp.is_published(2)
    assert not exp.publish(export(tmp_path, 2), 2).skipped  # main's step 2 is not exp's
    assert repo.tags["exp/step-2"] == repo.branches["stagerd/exp/step-2"] != repo.tags["step-2"]
