"""Which places a sink owns under its URL, so that no sink, no exchange and no ROOT lies among another
one's files: `check_sinks` is every command's check of its --sink URLs (`watch`'s settings, `publish`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from stagerd.errors import ConfigError
from stagerd.sinks.claims import CLAIMS_DIR
from stagerd.sinks.fetch import LATEST_NAME, RAW_DIR
from stagerd.sinks.leases import RESTORING_DIR
from stagerd.sinks.places import Place, place_of, real_dir, refuse_duplicates
from stagerd.sinks.prune import FLEET_DIR
from stagerd.sinks.urls import SinkKind, parse_sink_url, shown

_OWN = frozenset({RAW_DIR, CLAIMS_DIR, FLEET_DIR, RESTORING_DIR, LATEST_NAME})
_SINK_HINT = (
    "give each sink a directory or prefix of its own, side by side (e.g. s3://BUCKET/a and s3://BUCKET/b) "
    "or in another folder of the outer one; nothing was written"
)


@dataclass(frozen=True)
class Area:
    """A URL whose top-level names one writer owns: a sink, or the fleet's exchange (`daemon/fleet`).
    `what` names it in messages; `owns(top)`: whether it reads, writes or deletes below `top`; `why`: what
    goes wrong when another lies there; `hint`: what to do instead."""

    url: str
    what: str
    owns: Callable[[str], bool]
    why: str
    hint: str


def sink_area(url: str) -> Area:
    return Area(
        url,
        "sink",
        own_name,
        "the outer sink's listings and retention would take the inner one's files for its own, and could "
        "delete them",
        _SINK_HINT,
    )


def check_sinks(urls: Sequence[str]) -> None:
    """Every URL parsed strictly, then no place given twice and none inside another's own places: a
    ConfigError before anything is created."""
    for url in urls:
        parse_sink_url(url)  # a ConfigError with the closest valid form
    refuse_duplicates(list(urls))
    refuse_nested([sink_area(u) for u in urls])


def refuse_nested(areas: Sequence[Area]) -> None:
    """One area inside another's own places (`s3://b/p/raw/x` or `file:///x/step-00000001` beside `s3://b/p`,
    `file:///x`): the outer one's listings, claims and retention would meet the inner one's files under its
    own names, and could delete them. An area in another directory of the outer one (`s3://b/p/sub`) is left
    alone: each reads, writes and deletes only names of its own (`own_name`). Compared by their resolved
    places (`places.py`: a `file://` sink through a symlink is where the link leads); two equal places are
    not nested (duplicate sinks are `refuse_duplicates`'s)."""
    placed: list[tuple[Place, Area]] = []
    for area in areas:
        if parse_sink_url(area.url, what=f"{area.what} URL").kind is not SinkKind.HUB:
            placed.append((place_of(area.url, what=f"{area.what} URL"), area))
    for outer, outer_area in placed:  # a Hub repo's revisions are branches, not directories
        for inner, inner_area in placed:
            if outer.store != inner.store:
                continue  # other stores never nest
            top = _top_below(inner.path, outer.path)
            if top is not None and outer_area.owns(top):
                raise ConfigError(
                    f"{inner_area.what} {shown(inner_area.url)} lies inside {outer_area.what} "
                    f"{shown(outer_area.url)}, under its {top}: {outer_area.why}",
                    hint=next((a.hint for a in (inner_area, outer_area) if a.what != "sink"), _SINK_HINT),
                )


def own_name(top: str) -> bool:
    """Whether a sink reads, writes or deletes below the name `top` at its own top: its steps and its
    `raw/`, `claims/`, `fleet/`, `restoring/` and `latest`. A directory there is not another tool's."""
    return top in _OWN or top.startswith("step-")


def owner_of(path: str, areas: Sequence[Area]) -> tuple[Area, str] | None:
    """The local area among `areas` whose own places hold the local directory `path` (resolved as the
    areas are), and its name there; None where there is none."""
    real = real_dir(path)
    for area in areas:
        if parse_sink_url(area.url).kind is SinkKind.LOCAL:
            top = _top_below(real, place_of(area.url).path)
            if top is not None and area.owns(top):
                return area, top
    return None


def _top_below(inner: str, outer: str) -> str | None:
    """The first name of `inner` below `outer`, at a path-component boundary ("" is a bucket's or host's
    top); None where `inner` is not strictly below `outer`."""
    inner, outer = inner.strip("/"), outer.strip("/")
    if inner == outer or (outer and not inner.startswith(outer + "/")):
        return None
    return inner[len(outer) :].lstrip("/").split("/", 1)[0]
