"""The one strict parser of sink URLs.

Every way a destination reaches stagerd (`watch --sink`, `STAGERD_SINKS`, a config file, `publish --sink`,
`demo --sink`) goes through `parse_sink_url` before anything runs. A URL the stores would read loosely
(`s3:/bucket` as a local directory named `s3:`, `file://relative` as a path under the working directory,
`hf://org/repo#main` without its fragment) would publish to a place the operator did not mean and report
success, so anything but an exact form is a `ConfigError` whose hint is the closest valid URL.

Accepted forms:
- `s3://BUCKET[/PREFIX]` (also `s3a://`): no credentials, port or query in the URL;
- `hf://ORG/REPO[@REVISION][?option=value...]`;
- `file:///ABSOLUTE/PATH`, or a bare `/ABSOLUTE/PATH`, which means the same;
- `PROTOCOL://BUCKET-OR-HOST[/PATH]` for any other installed fsspec protocol that stores durably; the host
  may be an IPv6 literal in brackets (`sftp://user@[::1]:2222/PATH`), whose `::` and `[]` are no chain
  and no pattern.

An object store's prefix may not hold glob characters (`*`, `?`, `[`, `]`): s3fs and other fsspec stores
read them as patterns in `rm`, `glob` and `expand_path`, so a delete of `s3://bkt/run*/step-1` would reach
`run1/`, `run10/` and every other match. stagerd deletes exact keys only, and refuses such prefixes as well,
so that no pattern can ever reach a store through a library call added later (`refuse_patterns`).
A `file://` path may hold them: every local write, listing and delete is an exact `os` call.
"""

from __future__ import annotations

import ipaddress
import os
import re
import urllib.parse
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from stagerd.errors import ConfigError
from stagerd.sinks.url_text import shown

FORMS = "s3://BUCKET/PREFIX, hf://ORG/REPO[@REVISION], file:///ABSOLUTE/PATH or /ABSOLUTE/PATH"

# fsspec protocols that exist but keep nothing after the process ends, or cannot be written to.
_NOT_DURABLE = {
    "memory": "keeps the data in this process's memory only; it is gone when stagerd exits",
    "http": "is read-only in fsspec",
    "https": "is read-only in fsspec",
    "github": "is read-only in fsspec",
    "git": "is read-only in fsspec",
    "zip": "is an archive view, not a store",
    "tar": "is an archive view, not a store",
    "libarchive": "is an archive view, not a store",
    "reference": "is a read-only view of other files",
    "data": "is a data: URL, not a store",
    "cached": "is a local cache in front of another store; name that store instead",
    "simplecache": "is a local cache in front of another store; name that store instead",
    "filecache": "is a local cache in front of another store; name that store instead",
    "blockcache": "is a local cache in front of another store; name that store instead",
}

_READ_ONLY = ("http", "https", "github", "git", "zip", "tar", "libarchive", "reference", "data")


def unwritable(url: str) -> str | None:
    """Why the store `url` names can never be written to (fsspec reads it only), or None."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    return _NOT_DURABLE[scheme] if scheme in _READ_ONLY else None


_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):(.*)", re.S)
_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# `scheme://[userinfo@][IPV6]:port` up to the path: the bracketed host is group 1
_BRACKET_HOST = re.compile(
    r"[A-Za-z][A-Za-z0-9+.-]*://(?:[^/?#\[\]]*@)?(\[[^\]/?#]*\])(?::[0-9]*)?(?=[/?#]|$)"
)
PATTERN_CHARS = "*?[]"


class SinkKind(Enum):
    """Which sink implementation a URL opens."""

    LOCAL = "local"
    S3 = "s3"
    HUB = "hub"
    FSSPEC = "fsspec"


@dataclass(frozen=True)
class SinkUrl:
    """A checked sink URL. `url` is the text as given (it names the sink in the journal and logs);
    `location` is the bucket, host or Hub repo, `path` the prefix (a local sink's absolute directory)."""

    url: str
    kind: SinkKind
    protocol: str
    location: str
    path: str

    @property
    def local_path(self) -> Path:
        if self.kind is not SinkKind.LOCAL:
            raise ValueError(f"{shown(self.url)} is not a local sink")
        return Path(self.path)

    @property
    def place(self) -> tuple[str, str, str, str]:
        """Where it writes, as spelt: `file:///x/` and `/x`, `s3a://b/p` and `s3://b/p/`, a Hub repo with and
        without options are each one place. `places.place_of` also follows symlinks and defaults the
        revision: what sinks are compared by."""
        protocol = "s3" if self.kind is SinkKind.S3 else self.protocol
        return (self.kind.value, protocol, self.location, self.path)


def parse_sink_url(text: str, *, what: str = "sink URL") -> SinkUrl:
    """Check `text` strictly and say what it names; any doubt is a ConfigError with the closest valid form.
    `what` names the URL in the message (`--exchange URL`): the option the user gave."""
    try:
        return _parse(text)
    except ConfigError as e:
        if what == "sink URL" or not e.message.startswith("sink URL "):
            raise
        raise ConfigError(what + e.message.removeprefix("sink URL"), path=e.path, hint=e.hint) from None


def _parse(text: str) -> SinkUrl:
    if not isinstance(text, str) or not text.strip():
        raise _refuse(
            text if isinstance(text, str) else repr(text),
            "is empty: an unset variable or an empty list entry would publish to no place you chose",
            suggestion=None,
        )
    if text != text.strip() or _CONTROL.search(text):
        raise _refuse(text, "has spaces or control characters at its ends or inside", _clean(text))
    if "::" in without_ipv6_host(text):
        if "[" in text:  # an IPv6 host left unclosed or misspelt is no chain: say which it is
            try:
                urllib.parse.urlsplit(text)
            except ValueError as e:
                raise _refuse(text, f"has a malformed host: {e}", None) from None
        raise _refuse(text, "chains fsspec protocols; name the store itself", text.rsplit("::", 1)[-1])
    match = _SCHEME.fullmatch(text)
    if match is None:
        return _bare_path(text)
    scheme, rest = match.group(1), match.group(2)
    if scheme != scheme.lower():
        raise _refuse(text, "has an upper-case scheme", f"{scheme.lower()}:{rest}")
    if not rest.startswith("//"):
        raise _refuse(text, f"needs two slashes after {scheme}:", _with_slashes(scheme, rest))
    if "#" in text:
        raise _refuse(text, "has a #fragment, which no sink reads", _without_fragment(scheme, text))
    try:
        parts = urllib.parse.urlsplit(text)
    except ValueError as e:  # a bracketed host that is no IPv6 address, or an unclosed `[`
        raise _refuse(text, f"has a malformed host: {e}", None) from None
    if scheme in ("file", "local"):
        return _local(text, parts)
    if scheme in ("s3", "s3a"):
        return _s3(text, parts)
    if scheme == "hf":
        return _hub(text, parts)
    return _fsspec(text, parts)


# --- one function per kind -------------------------------------------------------------------------------


def _bare_path(text: str) -> SinkUrl:
    if not text.startswith("/"):
        raise _refuse(
            text,
            "is a relative path: it would land under whatever directory stagerd runs in",
            f"file://{os.path.abspath(os.path.expanduser(text))}",
        )
    return SinkUrl(text, SinkKind.LOCAL, "file", "", _checked_local_path(text, text))


def _local(text: str, parts: urllib.parse.SplitResult) -> SinkUrl:
    if parts.netloc:
        # file://relative/dir reads as a path under the working directory, file://host/... is not local
        raise _refuse(
            text,
            "names a host or relative path after file://; a local sink is file:///ABSOLUTE/PATH",
            _local_guess(parts.netloc + parts.path),
        )
    if parts.query:
        raise _refuse(text, "has a ?query, which a local directory cannot take", f"file://{parts.path}")
    if not parts.path:
        raise _refuse(text, "names no directory", "file:///ABSOLUTE/PATH")
    if urllib.parse.unquote(parts.path) != parts.path:
        # `Path.as_uri()` writes a space as %20; the stores read the path as it is, so the step would go to
        # a directory named `my%20run` beside `my run`. The bare path says either one exactly.
        raise _refuse(
            text,
            "has %-escapes, which the stores do not decode: it names a directory with '%' in its name",
            os.path.normpath(urllib.parse.unquote(parts.path)),
        )
    return SinkUrl(text, SinkKind.LOCAL, "file", "", _checked_local_path(text, parts.path))


def _local_guess(path: str) -> str:
    """`file://tmp/run` is most often `/tmp/run` with a slash lost; a relative path only when no top-level
    directory of that name exists."""
    top = path.split("/", 1)[0]
    if os.path.isdir(os.path.join("/", top)):
        return f"file:///{path}"
    return f"file://{os.path.abspath(path)}"


def _checked_local_path(text: str, path: str) -> str:
    tidy = os.path.normpath(path)
    if tidy == "/" or tidy == "//":
        raise _refuse(text, "is the root directory; give a directory of its own", "file:///srv/checkpoints")
    if _untidy(path):
        raise _refuse(text, "has empty, '.' or '..' parts", f"file://{tidy}")
    return tidy


def _s3(text: str, parts: urllib.parse.SplitResult) -> SinkUrl:
    scheme = parts.scheme
    if not parts.netloc:
        raise _refuse(text, "names no bucket", f"{scheme}://{parts.path.strip('/') or 'BUCKET/PREFIX'}")
    if "@" in parts.netloc or ":" in parts.netloc:
        raise _refuse(
            text,
            "carries credentials or a port; give credentials by AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
            "a profile or a role, and an endpoint by AWS_ENDPOINT_URL",
            f"{scheme}://{parts.netloc.rsplit('@', 1)[-1].split(':', 1)[0]}{parts.path}",
        )
    if parts.query:
        raise _refuse(
            text,
            "has a ?query, which S3 would take as part of the key",
            f"{scheme}://{parts.netloc}{parts.path}",
        )
    if not _HOST.fullmatch(parts.netloc):
        raise _refuse(text, "has a bucket name S3 does not allow", f"{scheme}://BUCKET{parts.path}")
    if _untidy(parts.path):
        raise _refuse(
            text,
            "has empty, '.' or '..' parts in its prefix",
            f"{scheme}://{parts.netloc}/{_tidy_key(parts.path)}".rstrip("/"),
        )
    refuse_patterns(text)
    return SinkUrl(text, SinkKind.S3, scheme, parts.netloc, parts.path.strip("/"))


def _hub(text: str, parts: urllib.parse.SplitResult) -> SinkUrl:
    full = (parts.netloc + parts.path).rstrip("/")
    repo_id, at, revision = full.partition("@")
    from stagerd.sinks.hub.url import repo_kind_problem

    if (problem := repo_kind_problem(repo_id)) is not None:
        why, meant = problem
        raise _refuse(text, f"is not hf://ORG/REPO[@REVISION]: {why}", meant and meant + (at + revision))
    segments = repo_id.split("/")
    if len(segments) != 2 or not all(segments):
        guess = "/".join(s for s in segments if s)
        if len(segments) > 2 and all(segments):
            guess = "/".join(segments[:2])
        if guess.count("/") != 1:
            guess = "ORG/REPO"
        raise _refuse(
            text, "is not hf://ORG/REPO[@REVISION]", f"hf://{guess}" + (f"@{revision}" if revision else "")
        )
    if at and ("@" in revision or not revision):
        first = revision.split("@", 1)[0] if revision.split("@", 1)[0] else "REVISION"
        raise _refuse(text, "needs exactly one non-empty @REVISION", f"hf://{repo_id}@{first}")
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise _refuse(text, f"has a repo id the Hub does not allow: {str(e).splitlines()[0]}", None) from None
    return SinkUrl(text, SinkKind.HUB, "hf", repo_id, revision)


def _fsspec(text: str, parts: urllib.parse.SplitResult) -> SinkUrl:
    import fsspec
    from fsspec.registry import known_implementations, registry

    scheme = parts.scheme
    if scheme in _NOT_DURABLE:
        raise _refuse(text, f"is not a durable store: {scheme}:// {_NOT_DURABLE[scheme]}", None)
    if scheme not in known_implementations and scheme not in registry:
        raise _refuse(text, f"has an unknown scheme {scheme}://", None)
    try:
        fsspec.get_filesystem_class(scheme)
    except (ImportError, ValueError) as e:
        why = known_implementations.get(scheme, {}).get("err") or str(e)
        raise _refuse(text, f"needs a package that is not installed: {why}", None) from None
    if not parts.netloc:
        raise _refuse(
            text,
            f"names no bucket or host after {scheme}://",
            f"{scheme}://{parts.path.strip('/') or 'BUCKET/PATH'}",
        )
    if parts.query:
        raise _refuse(
            text,
            "has a ?query, which the store would take as part of a name",
            f"{scheme}://{parts.netloc}{parts.path}",
        )
    if _untidy(parts.path):
        raise _refuse(
            text,
            "has empty, '.' or '..' parts",
            f"{scheme}://{parts.netloc}/{_tidy_key(parts.path)}".rstrip("/"),
        )
    refuse_patterns(text)
    return SinkUrl(text, SinkKind.FSSPEC, scheme, parts.netloc, parts.path.strip("/"))


def refuse_patterns(url: str) -> None:
    """A ConfigError for an object-store URL whose bucket or prefix holds glob characters (module docstring).

    Also called where a store is opened without the full parser (`stagerd prune`, `stagerd restore`, the
    sink's own constructor), so that a prefix published by an older stagerd is named, never rewritten."""
    scheme, sep, rest = without_ipv6_host(url).partition("://")
    if not sep or scheme in ("file", "local", "hf") or not any(c in rest for c in PATTERN_CHARS):
        return
    found = "".join(c for c in PATTERN_CHARS if c in rest)
    raise ConfigError(
        f"sink URL {shown(url)} holds the glob character(s) {found!r}: object stores and their tools read "
        "them as patterns, so one delete could reach other prefixes; stagerd refuses such prefixes",
        hint="publish to a prefix of letters, digits, '-', '_', '.' and '/'; to read one written before, "
        "copy it to such a prefix first (e.g. `aws s3 cp --recursive 's3://BUCKET/run[1]/' s3://BUCKET/run1/`)",
    )


def ipv6_host(url: str) -> tuple[int, int] | None:
    """Where in `url` its host is a bracketed IPv6 literal (`[::1]`, brackets included), or None."""
    m = _BRACKET_HOST.match(url)
    if m is None:
        return None
    try:
        ipaddress.IPv6Address(m.group(1)[1:-1])
    except ValueError:
        return None
    return m.start(1), m.end(1)


def without_ipv6_host(url: str) -> str:
    """`url` with an IPv6 literal host left out: what the chain and pattern checks read."""
    span = ipv6_host(url)
    return url if span is None else url[: span[0]] + url[span[1] :]


def canonical_host(netloc: str) -> str:
    """`netloc` with an IPv6 literal host in its compressed form (`[0:0::01]` is `[::1]`)."""
    span = ipv6_host("x://" + netloc)
    if span is None:
        return netloc
    a, b = span[0] - 4, span[1] - 4
    return f"{netloc[:a]}[{ipaddress.IPv6Address(netloc[a + 1 : b - 1]).compressed}]{netloc[b:]}"


# --- helpers ---------------------------------------------------------------------------------------------


def _untidy(path: str) -> bool:
    """Empty, '.' or '..' segments; one leading and one trailing slash are the URL's own."""
    inner = path.removeprefix("/").removesuffix("/")
    return bool(inner) and any(seg in ("", ".", "..") for seg in inner.split("/"))


def _tidy_key(path: str) -> str:
    return os.path.normpath("/" + path).lstrip("/")


def _clean(text: str) -> str:
    return _CONTROL.sub("", text).strip()


def _with_slashes(scheme: str, rest: str) -> str:
    if scheme in ("file", "local"):
        return f"file://{os.path.abspath(rest)}" if rest else "file:///ABSOLUTE/PATH"
    return f"{scheme}://{rest.lstrip('/')}"


def _without_fragment(scheme: str, text: str) -> str:
    base, _, fragment = text.partition("#")
    if scheme == "hf" and fragment and "@" not in base:
        # `#main` reads as a branch: the Hub sink spells a revision `@main`
        return f"{base.split('?', 1)[0]}@{fragment}" + (f"?{base.split('?', 1)[1]}" if "?" in base else "")
    return base


def _refuse(text: str, why: str, suggestion: str | None) -> ConfigError:
    quoted = shown(text)
    hint = f"did you mean {shown(suggestion)}?" if suggestion else f"use {FORMS}"
    return ConfigError(f"sink URL {quoted} {why}", hint=hint)
