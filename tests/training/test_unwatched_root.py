"""A Stager whose ROOT no daemon runs on says so once, at its first commit: its steps would stay there,
exported, published and deleted by none, until the disk fills (a daemon not started, or started on another
path). While `stagerd watch` holds ROOT's lock, nothing is said. One process."""

from __future__ import annotations

import logging

import torch

from stagerd.daemon.lock import RootLock

SAID = "no `stagerd watch` runs on"


def _save_two(root, caplog) -> list[logging.LogRecord]:
    from stagerd import Stager

    with caplog.at_level(logging.WARNING, logger="stagerd.stage"), Stager(root) as stager:
        for step in (1, 2):
            stager.save({"w": torch.zeros(4)}, step)
        stager.wait()
    return [r for r in caplog.records if SAID in r.getMessage()]


def test_the_first_commit_on_a_root_no_daemon_runs_on_says_so_once(tmp_path, caplog):
    root = tmp_path / "root"
    said = _save_two(root, caplog)
    assert len(said) == 1 and said[0].levelno == logging.WARNING, [r.getMessage() for r in said]
    text = said[0].getMessage()
    assert f"{SAID} {root} now: step 1 and the steps after it stay there" in text, text
    assert f"`stagerd watch {root} --sink URL`" in text, text


def test_nothing_is_said_while_a_daemon_holds_root(tmp_path, caplog):
    root = tmp_path / "root"
    with RootLock(root):  # the lock `stagerd watch` holds while it runs
        assert _save_two(root, caplog) == []
