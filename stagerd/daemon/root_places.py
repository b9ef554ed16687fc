"""ROOT and the local places others write: no `file://` sink or exchange among the staged steps, and ROOT
among no sink's or exchange's own names. Compared resolved, as sinks are among themselves
(`sinks/places.py`): a ROOT or a sink reached through a symlink is where the link leads. With `--adopt`,
the export root and local sinks outside every trainer checkpoint, and an `--export-dir` that can be one,
held by one ROOT alone."""

from __future__ import annotations

import os
import re
from pathlib import Path

from stagerd.config import Settings
from stagerd.contract import layout
from stagerd.contract.adopt.step_names import compile_step_regex, parse_step_name
from stagerd.daemon.fleet.exchange_places import exchange_area
from stagerd.errors import ConfigError
from stagerd.sinks.own_places import Area, owner_of, sink_area
from stagerd.sinks.places import real_dir
from stagerd.sinks.urls import SinkKind, parse_sink_url, shown


def check_root_places(root: Path, sinks: list[str], exchange: str | None) -> None:
    """A ConfigError, before anything is written, for a local sink or exchange in ROOT's staging places,
    or ROOT in theirs."""
    refuse_a_step_or_state_dir(root, "stagerd watch {root} --sink URL")
    areas = [sink_area(u) for u in sinks] + ([exchange_area(exchange)] if exchange is not None else [])
    _refuse_inside_root(root, areas)
    _refuse_root_inside(root, areas)


def step_or_state_dir(root: Path) -> tuple[str, Path] | None:
    """What `root` is when it is not a ROOT but a place inside one: a step directory (it holds the commit
    marker, or is named `step-N` with `model/`), a directory inside one, or a ROOT's `.stagerd` or inside
    it, with the ROOT it belongs to; None otherwise. A ROOT whose children are a trainer's checkpoints
    (`--adopt`, `step-N` of torchtitan with no `model/`) is no step directory."""
    where = root.resolve()
    for d in [where, *where.parents]:
        if d.name == layout.STATE_DIR:
            what = "a ROOT's state directory" if d == where else f"inside the state directory {d} of a ROOT"
            return what, d.parent
        why = layout.why_a_step_dir(d)
        if why is not None:
            what = f"a step directory ({why})" if d == where else f"inside the step directory {d} ({why})"
            return what, d.parent
    return None


def refuse_a_step_or_state_dir(root: Path, command: str) -> None:
    """A ConfigError for a ROOT that is a step directory, inside one, or in a `.stagerd`: the daemon would
    keep its journal and lock in the trainer's checkpoint, and retention there deletes it. `command`: what
    to run instead, `{root}` standing for the ROOT it belongs to."""
    found = step_or_state_dir(root)
    if found is not None:
        what, owner = found
        raise ConfigError(
            f"ROOT is {what}; give the ROOT it is in, {owner}",
            path=root,
            hint=f"run `{command.format(root=owner)}` instead; nothing was written",
        )


def _refuse_inside_root(root: Path, areas: list[Area]) -> None:
    """A local sink that is ROOT, or inside a step directory or the daemon's state, would write its copies
    among the staged data that retention then deletes: the published steps would exist nowhere (an
    exchange there, the fleet's raw parts and records). (One in another subdirectory of ROOT is left
    alone: nothing of stagerd's lives there.)"""
    real_root = Path(real_dir(root))
    for area in areas:
        target = parse_sink_url(area.url)
        if target.kind is not SinkKind.LOCAL:
            continue
        where = Path(real_dir(target.local_path))
        if where != real_root and real_root not in where.parents:
            continue
        top = where.relative_to(real_root).parts[:1]
        if not top or top[0] == layout.STATE_DIR or top[0].startswith("step-"):
            raise ConfigError(
                f"{area.what} {shown(area.url)} is ROOT {root} or inside its step or state directories: its "
                "copies would land among the staged steps",
                hint="publish to a directory outside ROOT, e.g. file:///mnt/models/run1",
            )


def _refuse_root_inside(root: Path, areas: list[Area]) -> None:
    """ROOT inside a local sink's own places (its step directories, `raw/`, `claims/`, `latest`...) or the
    exchange's (`raw/`, `fleet/`, `export/`): their writes would land among the staged steps
    (`SINK/raw/step-N` is ROOT's `step-N` when ROOT is `SINK/raw`) and their retention delete them. (ROOT
    in another directory of theirs is left alone: each touches only names of its own.)"""
    found = owner_of(str(root), areas)
    if found is not None:
        area, top = found
        raise ConfigError(
            f"ROOT {root} is inside {area.what} {shown(area.url)}, under its {top}: the {area.what} would "
            "write and delete among the staged steps",
            hint=f"stage outside the {area.what}'s directory, or in a directory of it that it does not use "
            f"(e.g. {area.what.upper()}/staging); nothing was written",
        )


ADOPTED_DIR = "adopted"  # the default export root: ROOT/.stagerd/adopted/


def adopt_root(root: Path, export_dir: Path | None) -> Path:
    return Path(export_dir) if export_dir is not None else root / layout.STATE_DIR / ADOPTED_DIR


def check_adopt_places(root: Path, work_root: Path, settings: Settings) -> None:
    """The export root and every local sink lie outside every checkpoint (a trainer's directory is only
    read, and its own retention deletes it whole), and --extras is a directory."""
    from stagerd.sinks.urls import SinkKind, parse_sink_url, shown

    custom = compile_step_regex(settings.adopt_step)
    real_root = root.resolve()
    _refuse_a_checkpoint(root, real_root, settings, custom)
    places = [("the export directory", work_root)]
    for url in settings.sinks:
        target = parse_sink_url(url)
        if target.kind is SinkKind.LOCAL:
            places.append((f"sink {shown(url)}", target.local_path))
    for what, place in places:
        where = Path(place).resolve()
        if where == real_root:
            raise ConfigError(f"{what} is ROOT {root}, where the trainer writes its checkpoints")
        if real_root not in where.parents:
            continue
        top = where.relative_to(real_root).parts[0]
        if parse_step_name(top, custom) is not None:
            raise ConfigError(
                f"{what} {place} is inside the trainer's checkpoint {top}: the trainer owns it",
                hint="choose a directory outside ROOT for this ROOT alone, e.g. --export-dir ROOT-exports",
            )
    if settings.extras is not None and not Path(settings.extras).is_dir():
        raise ConfigError("--extras is not a directory", path=settings.extras)
    if settings.export_dir is not None:
        _check_export_dir(root, Path(settings.export_dir))


def _refuse_a_checkpoint(
    root: Path, real_root: Path, settings: Settings, custom: re.Pattern[str] | None
) -> None:
    """ROOT that is itself one of the trainer's checkpoints (`checkpoint-6`, named with a step and in a
    layout --adopt reads): the daemon would write its journal and lock into the checkpoint the trainer owns,
    and find no checkpoint in it to adopt. Said before anything is written."""
    from stagerd.contract.adopt.presets import AUTO
    from stagerd.daemon.unadopted import unadoptable
    from stagerd.engine.adopt.detect import fitting_layout

    step = parse_step_name(real_root.name, custom)
    if step is None:
        return
    try:
        fit = fitting_layout(real_root, settings.adopt or AUTO)
    except OSError:
        return
    why = unadoptable(real_root) if fit is None else None
    if fit is None and why is None:
        return
    what = f"an --adopt {fit.name} checkpoint" if fit is not None else f"a checkpoint that {why}"
    raise ConfigError(
        f"ROOT is one of the trainer's checkpoints, not the folder that holds them: its name gives step "
        f"{step}, and it is {what}; the trainer owns it, and stagerd would write its journal and lock in it",
        path=root,
        hint=f"pass the folder that holds checkpoint-N, `stagerd watch {real_root.parent} --adopt ...`; "
        "nothing was written",
    )


def _check_export_dir(root: Path, export_dir: Path) -> None:
    """An --export-dir that cannot be one: a file, under a file, where no directory can be made, or in
    ROOT's `.stagerd` (the daemon's state, beside its journal and trash), other than the default there.
    Said before ROOT is locked and its fleet identity written, not in a traceback after."""
    hint = "give --export-dir a directory outside ROOT that this user can create, e.g. ROOT-exports"
    state = root.resolve() / layout.STATE_DIR
    where = export_dir.resolve()
    if (where == state or state in where.parents) and where != state / ADOPTED_DIR:
        raise ConfigError(
            f"--export-dir is ROOT's state directory {state} or inside it: the daemon's own",
            path=export_dir,
            hint=hint,
        )
    if export_dir.exists() and not export_dir.is_dir():
        raise ConfigError("--export-dir is not a directory", path=export_dir, hint=hint)
    made = layout.nearest_existing(export_dir)
    if not made.is_dir():
        raise ConfigError(
            f"--export-dir is under {made}, which is not a directory", path=export_dir, hint=hint
        )
    # Permissions do not tell (root may write anywhere, yet not in /proc): make a directory and remove it.
    probe = made / f".stagerd-probe-{os.getpid()}"
    try:
        probe.mkdir()
    except OSError as e:
        raise ConfigError(
            f"--export-dir cannot be created in {made}: {e.strerror}", path=export_dir, hint=hint
        ) from None
    probe.rmdir()


OWNER_NAME = ".stagerd-root"  # in an --export-dir: the identity and path of the ROOT whose exports it holds


def claim_export_dir(root: Path, work_root: Path, root_id: str) -> None:
    """An --export-dir holds one ROOT's exports: its work directories are named after the checkpoints
    (`checkpoint-500` in every HF Trainer run), so a second ROOT's daemon would rebuild, publish and delete
    the first's. The first daemon to use it writes its ROOT's identity there; another is a ConfigError."""
    owner = work_root / OWNER_NAME
    mine = f"{root_id} {root.resolve()}\n"
    work_root.mkdir(parents=True, exist_ok=True)
    if not owner.is_symlink() and not owner.exists():
        tmp = work_root / f"{OWNER_NAME}.tmp-{os.getpid()}"
        layout.write_bytes_atomic(tmp, mine.encode())
        try:
            os.link(tmp, owner)  # whole or absent, and only if no other daemon got there first
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    try:
        theirs = owner.read_text() if not owner.is_symlink() else ""
    except OSError as e:
        raise ConfigError(f"cannot read {OWNER_NAME}: {e.strerror}", path=owner) from None
    their_id, _, other = theirs.strip().partition(" ")
    if their_id != root_id and other == str(root.resolve()):
        layout.write_bytes_atomic(owner, mine.encode())  # this ROOT, its .stagerd made again since
    elif their_id != root_id:
        raise ConfigError(
            f"the export directory {work_root} holds the exports of another ROOT ({other or 'unknown'}): "
            "the daemons would rebuild, publish and delete each other's exports of same-named checkpoints",
            path=owner,
            hint="give each ROOT its own --export-dir (e.g. ROOT-exports beside ROOT), or leave it unset",
        )
