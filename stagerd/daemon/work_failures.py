"""What a failed export or publish leaves: the journal's record (retried later, or quarantined), the
metric, and one log line whose hint says what to do."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

from stagerd.contract import layout
from stagerd.daemon.journal import LaneState, StepState
from stagerd.daemon.outages import SinkOutages
from stagerd.daemon.policy import decide_failure, failure_note, sink_outage
from stagerd.daemon.state import log
from stagerd.daemon.yielding import YieldLedger
from stagerd.errors import StagerdError
from stagerd.sinks.hub.retries import redact
from stagerd.sinks.objects import redact_url

_URL = re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s`'\"<>]+")


class WorkFailures(SinkOutages):
    _marker_metadata: dict[int, Mapping[str, Any]]
    _yield_ledger: YieldLedger

    async def _work_failed(self, step: int, sink: str | None, attempt: int, err: BaseException) -> None:
        """Record and log a failed export (`sink` None) or publish: retried later, or quarantined."""
        publish = sink is not None
        f = decide_failure(err, attempt, self.settings, time.time(), publish=publish)
        if sink is not None and self.settings.once and sink_outage(f):
            # a --once run tries a sink `max_attempts` times in a row in all, not that often per step
            tries = max(attempt, self._sink_tries(sink))
            f = decide_failure(err, tries, self.settings, time.time(), publish=publish)
            self._sink_failed(sink, f)
        if self._adopt_root is None:
            on_disk = await self._io(layout.is_committed, self.root / layout.step_dir_name(step))
        else:
            row = await self._j(self._journal.step, step)
            on_disk = row is not None and await self._io(Path(row.path).is_dir)
        hint = recorded_hint(err, on_disk=on_disk)
        fail: Callable[..., StepState | LaneState]
        if sink is None:
            stage, what = "export", f"step {step}"
            fail = partial(self._journal.fail_export, step)
        else:
            stage, what = "publish", f"step {step} on {sink}"
            fail = partial(self._journal.fail_publish, step, sink)
        state: StepState | LaneState = await self._record(
            f"record the failed {stage} of {what}",
            fail,
            f.error_class,
            f.message,
            next_try=f.next_try,
            quarantine=f.quarantine,
            hint=hint,  # kept with the failure: `status` and a later `--once` summary say this case's
        )
        self.metrics.failures.labels(stage=stage, error_class=f.error_class).inc()
        if f.quarantine:
            self._yield_ledger.forget(step, sink)
        if f.quarantine and sink is not None:
            # Cached for the step's other lanes until it is published everywhere, which a quarantined lane
            # stops: kept, one entry per such step would stay for the daemon's life. `retry` reads it again.
            self._marker_metadata.pop(step, None)
        self._log_step(
            step,
            sink,
            state,
            error_class=f.error_class,
            note=failure_note(f, step, attempt, on_disk=on_disk, now=time.time()),
            level=logging.ERROR if f.quarantine or f.given_up or f.needs_fix else logging.WARNING,
            attempt=attempt,
            hint=hint,
        )
        if not isinstance(err, StagerdError):
            log.debug("unexpected error", exc_info=err)


def recorded_hint(err: BaseException, *, on_disk: bool) -> str | None:
    """What to do about `err`, with no secret in it: it is logged, and kept in the journal, which any user
    who may run `stagerd status` reads. A hint names a sink's URL at times, a Hub token never on purpose."""
    hint = (
        getattr(err, "hint", None)
        if on_disk or "hint" in vars(err)  # a hint given for this case itself
        else "the step was deleted from ROOT while in work; "
        "save it again to export it (the new save is picked up as a new version of the step)"
    )
    if not isinstance(hint, str):
        return None
    return redact(_URL.sub(_redact_url, hint), None)


def _redact_url(m: re.Match[str]) -> str:
    url = m.group()
    # only a URL that may hold a secret is rewritten: the rest stay exactly as the error wrote them
    return redact_url(url) if "@" in url or "?" in url else url
