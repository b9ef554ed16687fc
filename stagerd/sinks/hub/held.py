"""The steps a Hub repo holds, read from its step tags (`step-N` on main, `R/step-N` on a revision R: the
names a sink tags a verified step with, `url.py`), and the restore error that names them when the step or
revision asked for is not there: in the words an S3 or file:// restore uses (`sinks/fetch.py`).

Only tags count: a step is published once its tag is set. A step an older stagerd published on R under
main's names is found by `history.py` when asked for by number, but is listed as main's here."""

from __future__ import annotations

import re
from typing import Any

from stagerd.errors import RestoreError
from stagerd.sinks.hub.url import DEFAULT_REVISION, step_tag

_STEP_REF = re.compile(r"(?:^|/)step-([0-9]{1,19})$")  # ASCII, and within int()'s reach


def step_of_tag(revision: str) -> tuple[int, str | None] | None:
    """(step, the sink revision it is scoped to) where `revision` is the name a sink tags a step with
    (`step-N`, `R/step-N`), else None."""
    m = _STEP_REF.search(revision)
    if m is None:
        return None
    step, scope = int(m.group(1)), revision[: m.start()] or None
    return (step, scope) if step_tag(step, scope) == revision else None


def sink_revision(revision: str | None) -> str:
    """The revision a sink published to, for a restore's revision: a step tag's (`R/step-N`: R), else the
    revision itself, else main."""
    tag = step_of_tag(revision or "")
    return (tag[1] if tag is not None else revision) or DEFAULT_REVISION


def steps_by_revision(api: Any, repo_id: str) -> dict[str, list[int]]:
    """Each revision's published steps, newest first, by their step tags (one request); main first."""
    held: dict[str, list[int]] = {}
    for tag in api.list_repo_refs(repo_id).tags:
        found = step_of_tag(tag.name)
        if found is not None:
            held.setdefault(found[1] or DEFAULT_REVISION, []).append(found[0])
    order = sorted(held, key=lambda r: (r != DEFAULT_REVISION, r))  # main's first
    return {revision: sorted(held[revision], reverse=True) for revision in order}


def not_here(
    what: str, where: str, repo_id: str, revision: str, step: int | None, held: dict[str, list[int]] | None
) -> RestoreError:
    """The error for a restore of `step` (None: the revision's newest) from the sink on `revision` that
    lacks it (`what` says how), naming the steps `held` lists there, newest first, or the other revisions
    that hold the step or any step, and how to restore one. `held` None: the tags could not be read."""
    from stagerd.sinks.fetch import shown_steps

    held = held or {}
    here = held.get(revision, [])
    on = [r for r, steps in held.items() if r != revision and step in steps]
    elsewhere = [r for r in held if r != revision]
    hint = "check the step number (each published step is a tag step-N); nothing was restored"
    if here:
        what += f"; the sink holds {len(here)} exported step(s): {shown_steps(here)}"
    elif elsewhere:
        what += f"; the repo holds exported steps on {', '.join(elsewhere)} only"
    if on:  # published with `@R`: its tag is `R/step-N`, which this revision does not read
        hint = f"step {step} was published on {', '.join(on)}: restore hf://{repo_id}@{on[0]} --step {step}"
    elif here:
        hint = f"nothing was restored; give one of them with --step N (`--step {here[0]}`: the newest)"
    elif elsewhere:
        other = elsewhere[0]
        hint = (
            f"nothing was restored; restore from the revision the steps were published on: "
            f"hf://{repo_id}@{other} --step {held[other][0]} (its newest)"
        )
    return RestoreError(what, path=where, hint=hint)
