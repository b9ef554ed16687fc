"""Where a sink URL writes, resolved, so that two spellings of one place compare equal.

- `file://` (and a bare path): the directory's real path, every symlink on the way followed and any part
  that does not exist yet kept as written (`os.path.realpath`: a sink directory may not exist before its
  first publish), so `file:///link/run` and `file:///data/run` are one place when `/link` -> `/data`.
- S3 and other fsspec stores: the store, the bucket or host and the prefix as the parser tidied it. s3fs
  strips a trailing `/` and writes `PREFIX/KEY` (`s3/backend.py`), as the other stores' backend writes
  `ROOT/KEY` (`generic.py`); the parser refuses empty, `.` and `..` parts, so no two accepted spellings of
  a prefix write different keys, and none is collapsed here that would write other keys. Bucket and key
  are case-sensitive: `s3://b/Run` is another place than `s3://b/run`. An IPv6 literal host is one
  address however it is written: `[0:0::1]` is `[::1]`.
- The Hub: the repo and the revision, none meaning `main`, as the Hub sink reads it (`hub/sink.py`). The Hub
  finds a repo whatever the case of its id (`Org/Repo` is `org/repo`); a revision is a git ref, whose
  case counts.

A `file://` place that is a file, or lies under one, is no place at all: the user gave a file where a
directory belongs, a `ConfigError` when the place is resolved or the store opened (`refuse_a_file`).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from stagerd.errors import ConfigError
from stagerd.sinks.urls import SinkKind, canonical_host, parse_sink_url, shown

_HUB_DEFAULT_REVISION = "main"  # `HubSink`'s revision when the URL names none (`hub/url.py`)


@dataclass(frozen=True)
class Place:
    """`store`: (kind, protocol, bucket/host/repo), places in two stores never meet; `path`: the resolved
    directory, the prefix, or the Hub revision."""

    store: tuple[str, str, str]
    path: str


def place_of(url: str, *, what: str = "sink URL") -> Place:
    """The resolved place of `url` (module docstring); `what` names the URL in a parse error."""
    target = parse_sink_url(url, what=what)
    kind, protocol, location, path = target.place
    if target.kind is SinkKind.LOCAL:
        refuse_a_file(url, path, what=what)
        path = real_dir(path)
    elif target.kind is SinkKind.HUB:
        location, path = location.casefold(), path or _HUB_DEFAULT_REVISION
    else:
        location = canonical_host(location)
    return Place((kind, protocol, location), path)


def real_dir(path: str | os.PathLike[str]) -> str:
    """The directory a local path names once symlinks are followed; parts that do not exist yet are kept."""
    return os.path.realpath(path)


def refuse_a_file(url: str, path: str, *, what: str = "sink URL") -> None:
    """A ConfigError where the local directory `path` of `url` is a file, or lies under one, symlinks
    followed: no wait makes a directory of it, so the daemon would retry it for ever, a step at a time.

    Only what exists is judged. A directory not there yet is made at the first publish; one reached through
    a link whose target is gone (a filesystem not mounted) or that cannot be looked at now (a stale NFS
    handle) is a sink that is down, retried as any outage. A file that takes the directory's place once
    the daemon runs is such an outage too (`local_dirs.LocalTree.held`), as where the fleet opens its
    exchange again for a step (`fs_open.opening_again`)."""
    real = Path(real_dir(path))
    for at in [real, *real.parents]:
        try:
            st = os.stat(at)
        except (FileNotFoundError, NotADirectoryError):
            continue  # not there yet: the first existing part above decides
        except OSError:
            return
        if stat.S_ISDIR(st.st_mode):
            return
        where = "names a file" if at == real else "lies under this file"
        raise ConfigError(
            f"{what} {shown(url)} {where}, where a directory belongs",
            path=at,
            hint="give a directory, or a path where one can be made (e.g. file:///mnt/models/run1); "
            "nothing was written",
        )


def refuse_duplicates(urls: list[str]) -> None:
    """Two URLs for one place would be two lanes writing the same files, each step published twice."""
    seen: dict[Place, str] = {}
    for url in urls:
        place = place_of(url)
        if place in seen:
            raise ConfigError(
                f"sinks {shown(seen[place])} and {shown(url)} are the same place: each step would be "
                "published there twice, by two lanes at once",
                hint="give each destination once; nothing was written",
            )
        seen[place] = url
