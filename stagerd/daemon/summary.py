"""The end of a `--once` run: how many steps were published (and the newest few), which were not and why,
and the exit code. A daemon's ROOT collects retired steps for months: the summary names only the newest
`NEWEST_LISTED` published ones, so its line does not grow with every step ever seen."""

from __future__ import annotations

from dataclasses import dataclass, field

from stagerd.daemon.journal import FAILED, PUBLISHED, QUARANTINED, LaneRow
from stagerd.daemon.journal.schema import LOST_NOTE
from stagerd.daemon.outages import SinkOutages
from stagerd.daemon.policy import failure_hint, given_up, left_waiting
from stagerd.daemon.state import log
from stagerd.daemon.unadopted import LOST_HINT
from stagerd.daemon.unfinished import Unfinished, newest_of, unfinished_text
from stagerd.errors import SinkDownError

NEWEST_LISTED = 10  # published steps named in the summary line, newest first dropped last


@dataclass
class Summary:
    """What a `--once` run leaves behind."""

    published_count: int = 0  # steps published, retired ones included
    published: list[int] = field(default_factory=list)  # the newest `NEWEST_LISTED` of them, ascending
    published_now: int = 0  # of them, those this run published: the rest were published by earlier runs
    unpublished: list[tuple[int, str]] = field(default_factory=list)  # (step, why)
    # (count, newest) of the steps `stagerd restore` landed: never published by a daemon, so not counted
    restored: tuple[int, list[int]] = (0, [])
    # sink -> (count, newest) of the retired steps it never got: retired before it was configured
    missed: dict[str, tuple[int, list[int]]] = field(default_factory=dict)
    quarantined: bool = False  # a step left, or a lane of a configured sink, quarantined for good
    # one given up only as this run ran out of tries of what may pass: the next start tries it again
    given_up: bool = False
    # sink -> (its last failure, the steps left for the next start) of each sink this run found down
    down: dict[str, tuple[str, list[int]]] = field(default_factory=dict)
    # (count, newest) of the saves in ROOT left alone as unfinished: not steps yet, so not counted
    unfinished: tuple[int, list[Unfinished]] = (0, [])
    # (count, newest, of them this run's) of the adopted steps lost for good: their trainer deleted the
    # checkpoint before it was exported, so no run can publish them and none counts them unpublished
    lost: tuple[int, list[int], int] = (0, [], 0)
    # the folders of ROOT that give no step number but hold checkpoints (ROOT given one level too high),
    # each with why, as the last scan found them
    nested: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.unpublished


class OnceSummary(SinkOutages):
    async def _summary(self) -> Summary:
        rows = await self._j(self._journal.steps, include_retired=False)
        lanes: dict[int, list[LaneRow]] = {}
        for ln in await self._j(self._journal.lanes, include_retired=False):  # a retired step's are done
            lanes.setdefault(ln.step, []).append(ln)
        retired, newest = await self._j(self._journal.retired_summary, NEWEST_LISTED)
        out = Summary(published_count=retired, published=newest)
        out.published_now = await self._j(self._journal.published_since, self._started)
        out.restored = await self._j(self._journal.retired_summary, NEWEST_LISTED, restored=True)
        configured = set(self._lane_keys())
        down = {sink: f"{f.error_class}: {f.message}" for sink, f in self.down_sinks().items()}
        out.missed = await self._j(self._journal.missed, self._lane_keys(), NEWEST_LISTED)
        out.unfinished = (len(self._unfinished), newest_of(self._unfinished, NEWEST_LISTED))
        out.nested = list(self._nested)
        lost, lost_newest = await self._j(self._journal.lost_summary, NEWEST_LISTED)
        out.lost = (lost, lost_newest, await self._j(self._journal.lost_since, self._started) if lost else 0)
        for r in rows:
            if r.state == PUBLISHED:
                out.published_count += 1
                out.published.append(r.step)
                continue
            why: list[str] = (
                [f"{r.state}: {r.error_class}: {r.error_message}{_hint_of(r.error_class, r.error_hint)}"]
                if r.error_class
                else [r.state]
            )
            if r.state == FAILED and r.next_try is None:  # a fleet step left waiting: say what to do
                why = [_waiting(r.error_class, r.error_message, r.error_hint)]
            # a lane of a sink no longer configured neither holds the step back nor is worked on
            left = [ln for ln in lanes.get(r.step, ()) if ln.state != PUBLISHED and ln.sink in configured]
            for ln in left:
                if ln.sink in down and (
                    left_waiting(ln.state, ln.next_try) or given_up(ln.state, ln.error_class)
                ):
                    out.down.setdefault(ln.sink, (down[ln.sink], []))[1].append(r.step)
                    out.given_up = True
                    why.append(f"{ln.sink} still waiting (not quarantined): down, left for the next start")
                else:
                    why.append(_lane_why(ln))
            out.unpublished.append((r.step, "; ".join(why)))
            for state, cls in [(r.state, r.error_class), *((ln.state, ln.error_class) for ln in left)]:
                if state == QUARANTINED:
                    out.given_up |= given_up(state, cls)
                    out.quarantined |= not given_up(state, cls)
        out.published = sorted(out.published)[-NEWEST_LISTED:]
        return out

    def _report(self, summary: Summary) -> int:
        code = self._report_steps(summary)
        # Not a failure: no later run can send those steps, so an exit code of 1 would fail every run after.
        for sink, (count, steps) in summary.missed.items():
            log.warning(missed_text(sink, count, steps), extra={"sink": sink, "missed": steps})
        if summary.restored[0]:
            log.info(restored_text(*summary.restored), extra={"restored": summary.restored[1]})
        # Not a failure either: the trainer may still be writing it, and the next run takes it up.
        if summary.unfinished[0]:
            count, shown = summary.unfinished
            text = unfinished_text(count, shown, self.settings.adopt is not None)
            log.warning("--once: %s", text, extra={"unfinished": [u.name for u in shown]})
        if summary.lost[0]:
            log.warning("--once: %s", lost_text(*summary.lost), extra={"lost": summary.lost[1]})
        # The run that lost a step says so once in its exit code; later ones cannot mend it, so exit 0.
        return 1 if summary.lost[2] and code == 0 else code

    def _report_steps(self, summary: Summary) -> int:
        if summary.ok:
            lacking = ", ".join(f"{s} lacks {n}" for s, (n, _) in summary.missed.items())
            log.info(
                "--once: %s%d step(s) published%s, %s%s",
                "" if summary.missed or summary.unfinished[0] or summary.lost[0] else "all ",
                summary.published_count,
                _newest(summary),
                this_run(summary.published_now),
                f", not all on every sink: {lacking} (retired before it was configured)" if lacking else "",
                extra={
                    "published": summary.published_count,
                    "published_this_run": summary.published_now,
                    "newest_published": summary.published,
                },
            )
            return 0
        log.error(
            "--once: %d step(s) published, %d NOT published%s, %s",
            summary.published_count,
            len(summary.unpublished),
            _newest(summary),
            this_run(summary.published_now),
            extra={
                "published": summary.published_count,
                "published_this_run": summary.published_now,
                "newest_published": summary.published,
                "unpublished": [s for s, _ in summary.unpublished],
            },
        )
        for step, why in summary.unpublished:
            log.error("step %d not published: %s", step, why, extra={"step": step, "state": "unpublished"})
        for sink, (failure, steps) in summary.down.items():
            log.error(down_text(sink, failure, steps), extra={"sink": sink, "down": steps})
        return 1


def _listed(count: int, steps: list[int]) -> str:
    """`1, 2, 3`, or `newest 3: 7, 8, 9` where `count` steps are more than the ones shown."""
    shown = ", ".join(map(str, steps))
    return f"newest {len(steps)}: {shown}" if count > len(steps) else shown


def this_run(count: int) -> str:
    """How many of the published steps this run published: a cron's run says what it did itself."""
    return f"{count} by this run"


def missed_text(sink: str, count: int, steps: list[int]) -> str:
    """One line: which retired steps `sink` never got, and why."""
    which = _listed(count, steps)
    return (
        f"{sink} never got {count} step(s) ({which}): retention deleted their staged data before this "
        "sink was configured (of an adopted checkpoint, the trainer's checkpoint is gone or saved again "
        "too, or the sink's remote retention would not keep it), so stagerd cannot publish them there; "
        "copy them from a sink that holds them if need be"
    )


def down_text(sink: str, failure: str, steps: list[int]) -> str:
    """One line: a sink this `--once` run found down, the steps it left for the next start, and what to do."""
    return (
        f"{sink} is down: {len(steps)} step(s) left for the next start ({', '.join(map(str, steps))}); "
        f"its last failure: {failure} (hint: {SinkDownError.hint})"
    )


def lost_text(count: int, newest: list[int], now: int) -> str:
    """One line of the `--once` summary: the steps lost for good, which no run counts unpublished."""
    which = _listed(count, newest)
    return (
        f"{count} step(s) lost ({which}; {now} by this run): {LOST_NOTE}, so nothing can publish it; "
        f"{LOST_HINT}"
    )


def restored_text(count: int, steps: list[int]) -> str:
    """One line: the steps `stagerd restore` landed, which the daemon leaves as they are."""
    which = _listed(count, steps)
    return f"{count} step(s) restored by `stagerd restore` ({which}): not published again, left as they are"


def _newest(summary: Summary) -> str:
    """` (published: 7, 8, 9)`, or ` (newest 10 published: ...)` when more were; "" for none."""
    if not summary.published:
        return ""
    shown = ", ".join(map(str, summary.published))
    more = summary.published_count > len(summary.published)
    return f" (newest {len(summary.published)} published: {shown})" if more else f" (published: {shown})"


def _lane_why(ln: LaneRow) -> str:
    if ln.state == FAILED and ln.next_try is None:  # a missing bucket, a refused token: it waits
        return f"{ln.sink} {_waiting(ln.error_class, ln.error_message, ln.error_hint)}"
    if ln.error_class is None:  # not tried yet: its step stopped before it (quarantined, say)
        return f"{ln.sink} {ln.state}"
    return (
        f"{ln.sink} {ln.state}: {ln.error_class}: {ln.error_message}{_hint_of(ln.error_class, ln.error_hint)}"
    )


def _hint_of(error_class: str | None, recorded: str | None) -> str:
    """` (hint: ...)`: what to do (check the token, free space), for the summary's line of a step left,
    which is all a user of `--once` may read: the hint its failure gave, kept in the journal by whichever
    run failed it, else its class's; "" for a class without one."""
    hint = failure_hint(error_class, recorded)
    return f" (hint: {hint})" if hint else ""


def _waiting(error_class: str | None, message: str | None, recorded: str | None) -> str:
    hint = failure_hint(error_class, recorded)
    then = f"hint: {hint}" if hint else "the next start tries again"
    return f"still waiting (not quarantined): {error_class}: {message}; {then}"
