"""A listing's names, each taken only where it is really under the prefix asked for.

A store may answer a listing with names outside it: fsspec's `find` normalising a path, a sibling whose
name only starts with the prefix's (`step-1` and `step-10`), a server that ignores S3's `Prefix`. Sliced by
the prefix's length, such a name became a key of the listed step, and a prune or sweep then named it in
a delete. Such names are skipped, not refused: nothing outside the prefix is ever acted on, and what is
under it is listed exactly, so a store that lists its siblings too still publishes and prunes its own.
"""

from __future__ import annotations

import logging

log = logging.getLogger("stagerd.sinks")


def under(base: str, name: str, outside: list[str] | None = None) -> str | None:
    """`name` relative to `base` (which ends in `/`, or is "" for a whole bucket), or None where it is
    not under it; such a name goes to `outside`, unless it is the base itself (a folder marker, with its
    slash or without), which is no key of it and no other's."""
    if name.startswith(base) and len(name) > len(base):
        return name[len(base) :]
    if outside is not None and name not in (base, base[:-1]):
        outside.append(name)
    return None


def skipped(where: str, names: list[str]) -> None:
    """One warning for a listing's names outside its prefix (never acted on)."""
    if names:
        log.warning(
            "%s: the store listed %d name(s) outside this prefix (first: %r); left alone",
            where,
            len(names),
            names[0],
        )
