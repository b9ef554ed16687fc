"""A step the trainer's rotation deleted before it was exported is retired as lost: `stagerd status` shows
it as lost, with why, in its table and its JSON, and counts it apart from the retired steps."""

from __future__ import annotations

import os

from rich.console import Console

from stagerd.cmd.status import collect
from stagerd.cmd.status_table import render
from stagerd.daemon.journal import Journal
from stagerd.daemon.journal.schema import LOST_NOTE


def _journal(root):
    j = Journal.open(root)
    try:
        for step in (3, 4):
            j.add_step(step, root / f"checkpoint-{step}", 1000.0 + step, f"dcp:{step}")
        j.retire_lost(3, LOST_NOTE)
    finally:
        j.close()


def _render(doc) -> str:
    console = Console(width=120, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    render(doc, console)
    return console.export_text()


def test_status_shows_a_lost_step_as_lost_with_why(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    _journal(root)
    doc = collect(root, include_retired=True)
    steps = {s["step"]: s for s in doc["steps"]}
    assert (steps[3]["state"], steps[3]["error_class"], steps[3]["error_message"]) == (
        "lost", "CheckpointDeleted", LOST_NOTE
    )  # fmt: skip
    assert "--delete-adopted --keep-last N" in steps[3]["error_hint"] and steps[4]["state"] == "committed"
    assert (doc["counts"]["lost"], doc["counts"]["retired"]) == (1, 0), doc["counts"]
    text = _render(doc)
    row = next(ln for ln in text.splitlines() if ln.lstrip().startswith("3 "))
    assert "lost" in row and "retired" not in row and "the trainer deleted" in row, text
    assert "1 committed, 1 lost" in text, text
    listed = _render(collect(root, include_retired=False))  # counted, not listed, without --all
    assert "1 committed, 1 lost" in listed and not any(
        ln.lstrip().startswith("3 ") for ln in listed.splitlines()
    )
