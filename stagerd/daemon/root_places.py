"""ROOT and the local places others write: no `file://` sink or exchange among the staged steps, and ROOT
among no sink's or exchange's own names. Compared resolved, as sinks are among themselves
(`sinks/places.py`): a ROOT or a sink reached through a symlink is where the link leads."""

from __future__ import annotations

from pathlib import Path

from stagerd.contract import layout
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
        marked = (d / layout.MARKER_NAME).is_file()
        if marked or (layout.parse_step_dir(d.name) is not None and (d / layout.MODEL_DIR).is_dir()):
            why = (
                f"it holds {layout.MARKER_NAME}"
                if marked
                else f"it is named {d.name} with {layout.MODEL_DIR}/ inside"
            )
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
