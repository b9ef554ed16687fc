"""Retired adopted checkpoints and sinks added since: retention removed stagerd's export of a published
old step, never (without `--delete-adopted`) the trainer's checkpoint. A sink configured after that gets
the step exported again from the checkpoint, while it still holds the save the other sinks have and the
sink's remote retention would keep it (not exported only to be pruned there); the steps it cannot get (the
checkpoint gone, or saved again) are named once, at the start that adds it (`Discovery._say_missed`)."""

from __future__ import annotations

from pathlib import Path

from stagerd.daemon.adopt import Adoption
from stagerd.daemon.journal import COMMITTED
from stagerd.daemon.journal.raw import RAW_LANE_PREFIX
from stagerd.daemon.journal.schema import RETIRED_WITH_HISTORY
from stagerd.daemon.state import log


class RetiredAdoption(Adoption):
    async def _revive_missed(self) -> None:
        """At start: every retired adopted step a configured sink lacks (one whose lanes are kept: which
        sinks have it is known) goes back to `committed` where its checkpoint holds the save it was."""
        if self._adopt_root is None:
            return
        missed = await self._j(self._journal.missed, self._lane_keys(), RETIRED_WITH_HISTORY)
        known = sorted(await self._j(self._journal.known_steps))
        lacking: dict[int, list[str]] = {}
        for sink, (_, steps) in missed.items():
            store = self._prune_stores.get(sink.removeprefix(RAW_LANE_PREFIX))
            # what the sink's own retention would delete at its next publish is not exported to send there
            dropped = [s for s in steps if store is not None and not store[1].keeps(s, known)]
            if dropped:
                log.info(
                    "%s: %d retired step(s) not exported again for it, its remote retention would not keep "
                    "them (%s)",
                    sink,
                    len(dropped),
                    ", ".join(map(str, dropped[-10:])),
                )
            for step in steps:
                if step not in dropped:
                    lacking.setdefault(step, []).append(sink)
        for step, sinks in sorted(lacking.items()):
            row = await self._j(self._journal.step, step)
            if row is None or row.marker_id is None:
                continue
            if await self._io(self._adopted_identity, Path(row.path)) != row.marker_id:
                continue  # gone, or another save of the step: said by `_say_missed`
            why = f"retired; exported again from the trainer's checkpoint for {', '.join(sorted(sinks))}"
            await self._j(self._journal.revive, step, why)
            self._log_step(step, None, COMMITTED, note=why)
