"""Which places a sink owns under its URL, so that no sink and no ROOT lies among another sink's files."""

from __future__ import annotations

from stagerd.errors import ConfigError
from stagerd.sinks.claims import CLAIMS_DIR
from stagerd.sinks.fetch import LATEST_NAME, RAW_DIR
from stagerd.sinks.leases import RESTORING_DIR
from stagerd.sinks.prune import FLEET_DIR
from stagerd.sinks.urls import SinkKind, parse_sink_url, shown

_OWN = frozenset({RAW_DIR, CLAIMS_DIR, FLEET_DIR, RESTORING_DIR, LATEST_NAME})


def refuse_nested(urls: list[str]) -> None:
    """One sink inside another's own places (`s3://b/p/raw/x` or `file:///x/step-00000001` beside
    `s3://b/p`, `file:///x`): the outer sink's listings, claims and retention would meet the inner one's
    files under its own names, and could delete them. A sink in another directory of the outer one
    (`s3://b/p/sub`) is left alone: a sink reads, writes and deletes only names of its own (`own_name`).
    Checked on the URLs as written, as duplicates are (`refuse_duplicates` first: one place is not nested
    in itself)."""
    checked = [(parse_sink_url(url), url) for url in urls]
    for outer, outer_url in checked:
        for inner, inner_url in checked:
            if outer.kind is SinkKind.HUB or outer.place[:3] != inner.place[:3]:
                continue  # a Hub repo's revisions are branches, not directories; other stores never nest
            top = _top_below(inner.path, outer.path)
            if top is not None and own_name(top):
                raise ConfigError(
                    f"sink {shown(inner_url)} lies inside sink {shown(outer_url)}, under its {top}: the "
                    "outer sink's listings and retention would take the inner one's files for its own, and "
                    "could delete them",
                    hint="give each sink a directory or prefix of its own, side by side (e.g. s3://BUCKET/a "
                    "and s3://BUCKET/b) or in another folder of the outer one; nothing was written",
                )


def own_name(top: str) -> bool:
    """Whether a sink reads, writes or deletes below the name `top` at its own top: its steps and its
    `raw/`, `claims/`, `fleet/`, `restoring/` and `latest`. A directory there is not another tool's."""
    return top in _OWN or top.startswith("step-")


def _top_below(inner: str, outer: str) -> str | None:
    """The first name of `inner` below `outer`, at a path-component boundary ("" is a bucket's or host's
    top); None where `inner` is not strictly below `outer`."""
    inner, outer = inner.strip("/"), outer.strip("/")
    if inner == outer or (outer and not inner.startswith(outer + "/")):
        return None
    return inner[len(outer) :].lstrip("/").split("/", 1)[0]
