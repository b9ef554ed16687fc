"""Where a command's local output may not go: a staging ROOT, one of its step directories, or its `.stagerd`.

A step directory is the Stager's and the daemon's: the daemon exports and publishes what is in it (an
`export/` put there is taken for the step's own) and retention deletes it with everything inside, and a
directory named like a step with no marker is taken for a save in progress. `publish` (a local sink),
`consolidate` (OUT) and `restore` (ROOT, or `--export` OUT) each refuse those places before they write;
the last two also refuse an OUT that is a mount point, and a raw restore replaces an uncommitted step
directory only while it holds nothing of the user's.
"""

from __future__ import annotations

import os
from pathlib import Path

from stagerd.contract import layout
from stagerd.errors import ConfigError


def is_a_root(d: Path) -> bool:
    """A daemon ran here, or a trainer committed a step here."""
    if (d / layout.STATE_DIR).is_dir():
        return True
    try:
        names = os.listdir(d)
    except OSError:
        return False
    return any(layout.parse_step_dir(n) is not None and (d / n / layout.MARKER_NAME).is_file() for n in names)


def staging_area(path: Path, *, root_ok: bool = False) -> str | None:
    """What `path` is among staged steps (`the staging ROOT D`, `inside a step directory of the staging ROOT
    D`, `inside the staged step or state directory D`), or None where it is none of those; `root_ok`: a
    staging ROOT itself is fine (a raw restore lands there)."""
    where = path.resolve()
    for d in [where, *where.parents]:
        if layout.why_a_step_dir(d) is not None or d.name == layout.STATE_DIR:
            return f"inside the staged step or state directory {d}"
        if not is_a_root(d):
            continue
        if d == where:
            return None if root_ok else f"the staging ROOT {d}"
        if layout.parse_step_dir(where.relative_to(d).parts[0]) is not None:
            return f"inside a step directory of the staging ROOT {d}"
        return None  # another directory under a ROOT, as `watch` allows
    return None


def refuse_staging_area(path: Path, what: str, *, root_ok: bool = False) -> None:
    """ConfigError where `path` lies among staged steps (`staging_area`), before anything is written."""
    inside = staging_area(path, root_ok=root_ok)
    if inside is not None:
        raise ConfigError(
            f"{what} is {inside}: the daemon would take what lands there for a step's own, and retention "
            "deletes a step with all it holds",
            path=path,
            hint="give a directory outside the staging ROOT's step directories and .stagerd; nothing was "
            "changed",
        )


def refuse_a_mount_point(out: Path, what: str) -> None:
    """A finished OUT is renamed into place, which a mount point cannot take (EBUSY): say so before the
    work, not in a traceback after it."""
    if os.path.ismount(out):
        raise ConfigError(
            f"{what} is a mount point: the finished directory is renamed into place, which it cannot take",
            path=out,
            hint=f"give a new directory inside it, e.g. {out / 'hf'}; nothing was changed",
        )


def refuse_foreign_files(step_dir: Path) -> None:
    """An uncommitted `ROOT/step-N` (a crashed save, a killed restore's landing) is replaced by the restored
    step, only while it holds nothing but a save's and the daemon's names: a file or directory of the
    user's there (notes, a copy of their own) is never deleted, and a file at the step's name is no save."""
    from stagerd.errors import StepExistsError

    if not os.path.lexists(step_dir):
        return
    if not step_dir.is_dir():
        raise StepExistsError(
            "exists and is not a directory; not overwritten", path=step_dir,
            hint="move it away, then run the restore again; nothing was changed",
        )  # fmt: skip
    foreign = layout.foreign_names(step_dir)
    if foreign:
        raise StepExistsError(
            f"is not committed and holds {layout.a_few(foreign)}, which no save writes; not overwritten",
            path=step_dir,
            hint="move those out of it (or the directory away), then run the restore again; nothing was "
            "changed",
        )
