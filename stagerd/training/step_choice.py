"""Which committed step a load or resume takes, from every rank's list of the steps under ROOT; and, when
there is none to take, a `LoadError` that names ROOT and what it holds (its committed steps, newest
first; or that it is missing, empty, or holds no step directories), so a typo'd path or a step the
daemon's retention deleted reads as what it is."""

from __future__ import annotations

import os
from pathlib import Path

from stagerd.contract import layout
from stagerd.errors import LoadError

_SHOWN = 5  # committed steps named in a message: the newest, the ones a user means


def ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def choose_step(
    seen: list[list[int]], step: int | None, root: Path | None = None, *, made: bool = False
) -> int:
    """The step every rank loads, from each rank's committed steps; a `LoadError` (the same on every rank)
    when no rank, or only some ranks, can see it. `root` is named where no rank sees the step; where only
    some do, their node-local ROOTs' paths differ, and are left out so every rank says the same; `made`:
    the Stager made ROOT itself, so it did not exist before."""
    if step is not None:
        missing = [r for r, steps in enumerate(seen) if step not in steps]
        if len(missing) == len(seen):
            raise _absent(f"step {step} is not committed under ROOT on any rank", seen, root, made)
        if missing:
            raise LoadError(
                f"step {step} is committed under ROOT on some ranks but not on {ranks_text(missing)}"
            )
        return step
    newest = max((max(steps) for steps in seen if steps), default=None)
    if newest is None:
        raise _absent("no committed step under ROOT on any rank", seen, root, made)
    missing = [r for r, steps in enumerate(seen) if newest not in steps]
    if missing:
        raise LoadError(
            f"the newest committed step, {newest}, is not under ROOT on {ranks_text(missing)}",
            hint="restore it onto those nodes (`stagerd restore`), or pass step= with a step all ranks hold",
        )
    return newest


def _absent(what: str, seen: list[list[int]], root: Path | None, made: bool) -> LoadError:
    committed = sorted({s for steps in seen for s in steps}, reverse=True)
    if committed:
        return LoadError(
            f"{what}; {committed_text(committed)}",
            path=root,
            hint="pass one of those steps, or none for the newest; a step the daemon's --keep-last deleted "
            "comes back from a sink it was published on: `stagerd restore URL ROOT --step N`",
        )
    if root is None:
        return LoadError(what)
    return LoadError(
        f"{what}: {holds(root, made)}",
        path=root,
        hint="check the path (a new run has nothing to load: skip the load); steps published on a sink "
        "come back with `stagerd restore URL ROOT`",
    )


def committed_text(committed: list[int]) -> str:
    """`committed` (newest first), a few of them, as a message names the steps ROOT holds."""
    shown = ", ".join(map(str, committed[:_SHOWN]))
    more = f" and {len(committed) - _SHOWN} older" if len(committed) > _SHOWN else ""
    return f"its committed steps, newest first: {shown}{more}"


def holds(root: Path, made: bool = False) -> str:
    """What `root`, with no committed step, holds: said in a message."""
    if made or not root.is_dir():
        missing = "it did not exist until this Stager made it" if made else "it does not exist"
        if not made and not root.parent.is_dir():
            missing += f", nor does {root.parent}"
        near = layout.closest_existing(root, made=made)
        return missing + (f"; did you mean {near}?" if near else "")
    try:
        names = sorted(os.listdir(root))
    except OSError as e:
        return f"it cannot be listed: {e.strerror or e}"
    steps = [n for n in names if layout.parse_step_dir(n) is not None]
    if steps:
        return f"its step directories hold no commit marker (saves not finished): {layout.a_few(steps[::-1])}"
    visible = [n for n in names if not n.startswith(".")]
    if visible:
        return f"it holds no step directories, only {layout.a_few(visible)}"
    return "it is empty"


def rolled_back(seen: list[list[int]], step: int) -> str | None:
    """What resuming from `step` means where ROOT holds later committed steps (a run rolled back after a
    loss spike, say), said when it resumes rather than at each save it then skips; None where none is."""
    later = sorted({s for steps in seen for s in steps if s > step})
    if not later:
        return None
    shown = ", ".join(map(str, later[:5])) + (f" and {len(later) - 5} more" if len(later) > 5 else "")
    return (
        f"resuming from step {step} while ROOT holds the later step(s) {shown}: this run's saves at those "
        f"steps are skipped (a committed step is never written again), and a resume without a step picks "
        f"step {later[-1]}; give a rolled-back run a ROOT of its own"
    )
