"""Whether an adopted checkpoint is gone with nothing of it left to publish: the one test by which the
daemon retires an adopted step as lost and `watch` leaves it out of the quarantined steps it warns of."""

from __future__ import annotations

import os
from pathlib import Path

from stagerd.contract import layout


def gone_unexported(step_dir: Path, work_dir: Path) -> bool:
    """The trainer's checkpoint `step_dir` is gone (its rotation deleted it), and no whole export of it is
    left in its export directory `work_dir` (one built before the rotation is still published from there).
    Whether a sink already has the step is the journal's to say."""
    return not os.path.lexists(step_dir) and not layout.export_is_whole(work_dir / layout.EXPORT_DIR)
