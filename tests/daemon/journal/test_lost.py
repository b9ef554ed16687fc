"""An adopted step whose trainer deleted its checkpoint before it was exported: retired as lost, never
published. It is no live step (no later run counts it unpublished), no step `stagerd restore` landed, and
a new save of its number is exported as any unpublished step's is."""

from __future__ import annotations

import time

from stagerd.daemon.journal import COMMITTED, QUARANTINED, RETIRED, Journal
from stagerd.daemon.journal.schema import LOST, LOST_NOTE


def test_a_lost_step_is_retired_apart_from_published_and_restored_ones(tmp_path):
    j = Journal.open(tmp_path)
    try:
        j.add_step(4, "/root/checkpoint-4", 1004.0, "dcp:a")
        j.quarantine_step(4, "AdoptError", "the checkpoint was deleted before it was exported")
        time.sleep(0.01)
        since = time.time()  # this run starts: step 4 was quarantined, and reported, by an earlier one
        j.record_restored(7, "/root/step-7", "marker:b", "s3://b/run")
        assert j.step(4).state == QUARANTINED
        j.retire_lost(4, LOST_NOTE)
        row = j.step(4)
        assert (row.state, row.error_class, row.error_message, row.published_at) == (
            RETIRED, LOST, LOST_NOTE, None
        )  # fmt: skip
        assert [r.step for r in j.steps(include_retired=False)] == []
        assert j.lost_summary(10) == (1, [4]) and j.lost_since(since) == 0  # lost then, not by this run
        j.add_step(5, "/root/checkpoint-5", 1005.0, "dcp:d")
        j.retire_lost(5, LOST_NOTE)
        assert j.lost_summary(10) == (2, [4, 5]) and j.lost_since(since) == 1
        assert j.retired_summary(10, restored=True) == (1, [7]) and j.retired_summary(10) == (0, [])
        assert j.missed(["file:///a"], 10) == {}
        # the trainer saves that step number again: a new save to export, not a conflict with a published one
        assert j.new_save(4, "/root/checkpoint-4", 2004.0, "dcp:c", "dcp:a") == COMMITTED
        assert j.step(4).retired_at is None and j.lost_summary(10) == (1, [5])
    finally:
        j.close()
