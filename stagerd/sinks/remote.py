"""A sink's store as restore, prune, leases and the fleet read and change it: exact keys, never patterns.

- **Exact keys.** A listing asks for `ROOT/<prefix>/` with its slash (`run1` never lists `run10/`, and
  `step-10000000` never lists `step-100000000/`), and takes only the names it returns that are under it
  (`listed.py`: a store may answer with others); a delete names keys a listing returned; no sink path ever
  goes to s3fs's or fsspec's `rm`, `glob` or `expand_path`, which read `*`, `?` and `[` as patterns.
  Object-store URLs with those characters are refused when the store opens (`urls.refuse_patterns`).
- **Conditional writes** (`put_if`, `delete_if`), for claims: S3's own `If-None-Match` / `If-Match`
  (`s3/store.py`); on file://, `link()` to create, and a `flock` on the file held while its tag is checked
  and it is replaced or unlinked (a local filesystem's, or NFS's lock manager); other fsspec stores have no
  portable condition: read, compare, write (documented as weaker).
- **The store's clock** (`clock`): S3's `Date`; file://, the mtime of a file written now (on NFS, the
  server's). Ages compare it with LastModified / mtime, both the store's: no two machines' clocks meet.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import functools
import os
import stat
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stagerd.contract.manifest import MAX_MANIFEST_BYTES
from stagerd.errors import RestoreError, SinkError
from stagerd.ops.crashpoints import crash_point
from stagerd.sinks.fs_open import filesystem_at, opening
from stagerd.sinks.local_dirs import Held, LocalTree
from stagerd.sinks.objects import MAX_LATEST_BYTES, StoredObject, redact_url
from stagerd.sinks.temp_names import temp_name
from stagerd.sinks.urls import PATTERN_CHARS, refuse_patterns

__all__ = ["MAX_MANIFEST_BYTES", "RemoteStore", "StoredObject"]


@dataclass
class RemoteStore:
    """An fsspec filesystem and the sink's root path in it; S3 through the sink's own backend."""

    fs: Any
    base: str
    url: str
    owns: list[Any] = field(default_factory=list)
    s3: Any = None  # the S3Backend: its client lists, streams whole objects and writes conditionally

    @classmethod
    def open(
        cls, url: str, *, workers: int = 8, storage_options: Mapping[str, Any] | None = None
    ) -> RemoteStore:
        import fsspec

        url = url.rstrip("/")
        refuse_patterns(url)
        protocol, path = fsspec.core.split_protocol(url)
        opts = dict(storage_options or {})
        with opening(url):  # as a sink opens for publish: a store that is down is a SinkError
            if protocol in ("s3", "s3a"):
                from stagerd.sinks.s3.backend import S3Backend

                b = S3Backend.open(url, opts, part_size=16 << 20, max_concurrency=workers, checksum="CRC32")
                return cls(b.fs, b.base.removeprefix("s3://"), redact_url(url), [b], b)
            if protocol in (None, "file", "local"):
                fs = fsspec.filesystem("file")
                return cls(fs, path or "/", redact_url(url))
            fs, root = filesystem_at(url, opts)
            return cls(fs, root.rstrip("/"), redact_url(url))

    @property
    def local(self) -> bool:
        return self.s3 is None and "file" in self.fs.protocol

    def path(self, key: str) -> str:
        return f"{self.base.rstrip('/')}/{key}" if self.base not in ("", "/") else f"/{key}"

    def where(self, key: str) -> str:
        return f"{self.url.rstrip('/')}/{key}"

    @functools.cached_property
    def tree(self) -> LocalTree:
        """file://: the sink's directories, each reached from its root without following a link."""
        return LocalTree(Path(self.path("")))

    # -- reading ------------------------------------------------------------------------------------------

    def read(self, key: str, limit: int = MAX_MANIFEST_BYTES) -> bytes | None:
        data = self._head(key, limit + 1)
        if data is not None and len(data) > limit:
            raise RestoreError(f"is larger than {limit} bytes", path=self.where(key))
        return data

    def _head(self, key: str, n: int) -> bytes | None:
        """At most `n` bytes of `key`; None if it is absent."""
        if self.s3 is not None:
            head: bytes | None = self.s3.read(key, n)  # a plain GET: S3 refuses a range of an empty object
            return head
        try:  # file://: never a FIFO's wait (a claim read by a prune), never more than `n` in memory
            with _http_status(self.where(key)):
                data: bytes | None = (
                    self.tree.read(key, n) if self.local else self.fs.cat_file(self.path(key), 0, n)
                )
        except FileNotFoundError:
            return None
        except OSError as e:
            raise SinkError(f"{type(e).__name__}: {e}", path=self.where(key)) from None
        return data

    def read_range(self, key: str, start: int, length: int) -> bytes:
        """`length` bytes of `key` from `start` (fewer at its end); FileNotFoundError if it is absent."""
        if self.local:
            with self.tree.opened(key) as f:
                return os.pread(f.fileno(), length, start)
        with _http_status(self.where(key)):
            data: bytes = self.fs.cat_file(self.path(key), start=start, end=start + length)
        return data

    def read_latest(self, key: str) -> bytes | None:
        """At most `MAX_LATEST_BYTES + 1` bytes of a `latest` pointer (None: absent), whatever its size.

        A sink shared with other tools may hold their `latest` there: a large or empty file, or on file:// a
        directory or a link to one (a common name for the newest checkpoint). It names no step (b"" for
        a directory), so it protects none and is never touched; failing on it would stop retention."""
        if self.local and (st := self.tree.lstat(key)) is not None and not stat.S_ISREG(st.st_mode):
            return b""  # a directory, a link, or a FIFO that would fail the read
        return self._head(key, MAX_LATEST_BYTES + 1)

    def objects(self, prefix: str = "", start: str = "") -> dict[str, StoredObject]:
        """Every object under `prefix/` ("" the whole sink) whose name relative to it starts with `start`
        (literally), by that relative name."""
        try:
            if self.s3 is not None:
                from stagerd.sinks.s3 import store as s3_store

                return s3_store.objects(self.s3, prefix, start)
            if self.local:
                walked = self.tree.files(prefix, start)  # never entering a link
                return {rel: StoredObject(st.st_size, st.st_mtime, _tag(st)) for _, rel, _, st in walked}
            found = self._fsspec_objects(prefix)
            return {rel: o for rel, o in found.items() if rel.startswith(start)}
        except SinkError:
            raise
        except OSError as e:
            raise SinkError(f"{type(e).__name__}: {e}", path=self.where(prefix)) from None

    def sizes(self, prefix: str) -> dict[str, int]:
        """Every object under `prefix/` (relative name -> size); {} if none."""
        return {rel: o.size for rel, o in self.objects(prefix).items()}

    def _fsspec_objects(self, prefix: str) -> dict[str, StoredObject]:
        base = self.path(prefix).rstrip("/")
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        strip = self.fs._strip_protocol(base).rstrip("/") + "/"
        out = {}
        for name, info in found.items():
            rel = self.fs._strip_protocol(name)
            if rel.startswith(strip) and info.get("type", "file") != "directory":
                out[rel[len(strip) :]] = StoredObject(int(info.get("size") or 0), None, _info_tag(info))
        return out

    def read_tagged(self, key: str) -> tuple[bytes, str | None] | None:
        """The bytes of `key` and the tag a conditional write compares; None if absent."""
        if self.s3 is not None:
            from stagerd.sinks.s3 import store as s3_store

            return s3_store.read_tagged(self.s3, key)
        if self.local:
            try:
                with self.tree.opened(key) as f:  # a FIFO's wait held a prune for good
                    st = os.fstat(f.fileno())
                    return f.read(min(st.st_size, MAX_MANIFEST_BYTES)), _tag(st)
            except FileNotFoundError:
                return None
        data = self.read(key)
        return None if data is None else (data, _str(self._fsspec_tag(key)))

    def _fsspec_tag(self, key: str, size: int | None = None) -> Any:
        try:
            info = self.fs.info(self.path(key))
        except FileNotFoundError:
            return None
        return _info_tag(info)

    def clock(self) -> float:
        """The store's own time now (see the module docstring)."""
        if self.s3 is not None:
            from stagerd.sinks.s3 import store as s3_store

            return s3_store.clock(self.s3)
        if self.local:
            try:
                with self.tree.held("") as top:
                    return top.clock()
            except FileNotFoundError:
                return time.time()  # no sink here yet, so nothing has an age: never made by a prune
        return time.time()  # other fsspec stores: no portable server time (documented)

    # -- writing ------------------------------------------------------------------------------------------

    def put(self, key: str, data: bytes) -> None:
        """Create or replace `key` (a lease: only its writer ever writes it)."""
        if self.s3 is not None:
            from stagerd.sinks.s3 import store as s3_store

            s3_store.put(self.s3, key, data)
        elif self.local:
            for attempt in (1, 2):  # a prune may remove the empty parent between mkdir and write
                try:
                    # its temp name says its writer: a killed one's is swept (`leases.dead_leases`)
                    self.tree.write(key, data, temp_name(Path(key)).name)
                    return
                except FileNotFoundError:
                    if attempt == 2:
                        raise
        else:
            with _http_status(self.where(key)):
                self.fs.pipe_file(self.path(key), data)

    def put_if(self, key: str, data: bytes, tag: str | None) -> str | None:
        """Write `key` only if it is absent (`tag` None) or still the version `tag`: the version written,
        or None when the condition failed."""
        if self.s3 is not None:
            from stagerd.sinks.s3 import store as s3_store

            return s3_store.put_if(self.s3, key, data, tag)
        if self.local:
            return _local_put_if(self.tree, key, data, tag)
        current = self.read_tagged(key)  # no portable condition: read, compare, write (weaker)
        if (current is None) != (tag is None) or (current is not None and current[1] != tag):
            return None
        self.fs.pipe_file(self.path(key), data)
        return _str(self._fsspec_tag(key, len(data)))

    def delete_if(self, key: str, tag: str | None) -> bool:
        """Delete `key` only while it is still the version `tag`; False if it changed or is gone."""
        if tag is None:
            return False
        if self.s3 is not None:
            from stagerd.sinks.s3 import store as s3_store

            return s3_store.delete_if(self.s3, key, tag)
        if self.local:
            try:
                h, name = self.tree.parent(key)
            except FileNotFoundError:
                return False
            with h, _locked(h, name, tag) as same:
                if same:
                    os.unlink(name, dir_fd=h.fd)
                    h.check()
                return same
        current = self.read_tagged(key)
        if current is None or current[1] != tag or self.undeletable([key]):  # see `delete`: left
            return False
        self.fs.rm_file(self.path(key))
        return True

    def delete(self, keys: list[str]) -> None:
        """Delete exactly `keys`; missing ones are fine."""
        if self.s3 is not None:
            from stagerd.sinks.s3 import store as s3_store

            s3_store.delete(self.s3, keys)
            return
        if self.local:
            self.tree.delete(keys)
            return
        bad = self.undeletable(keys)
        if bad:  # the whole batch refused before any key goes: never half a step
            raise SinkError(
                f"has glob characters: not deleted through fsspec, nor the {len(keys) - 1} other key(s) "
                "deleted with it",
                path=self.where(bad[0]),
                hint="rename or delete that object by hand; nothing was deleted",
            )
        for key in keys:
            try:
                self.fs.rm_file(self.path(key))
            except FileNotFoundError:
                pass

    def undeletable(self, keys: list[str]) -> list[str]:
        """The `keys` this store cannot delete exactly: on a generic fsspec store, names with glob
        characters (an async store without its own `_rm_file` deletes through `_rm`, which expands them).
        S3 deletes by `DeleteObjects` and file:// by `unlink`: every name is literal there."""
        if self.s3 is not None or self.local:
            return []
        return [k for k in keys if any(c in k for c in PATTERN_CHARS)]

    def remove_empty_dirs(self, prefix: str) -> None:
        """file://: remove the empty directories under `prefix/`, and it, deepest first (`rmdir` only: a
        directory someone writes into again is not empty and stays). Object stores have none."""
        if not self.local:
            return
        self.tree.remove_empty_dirs(prefix)  # the prefix itself too

    def close(self) -> None:
        for b in self.owns:
            b.close()


def _str(tag: Any) -> str | None:
    return None if tag is None else str(tag)


def _info_tag(info: Mapping[str, Any]) -> str:
    """An fsspec store's version of an object, as far as its listing says (weaker than a real ETag)."""
    for name in ("ETag", "etag", "generation", "mtime", "LastModified", "created"):
        value = info.get(name)
        if value is not None:
            # one time as a listing's float and as `info`'s datetime (memory://): one tag, or no claim
            # read back ever matched its listing and no published step was pruned
            return f"{name}:{value.timestamp() if isinstance(value, datetime.datetime) else value}"
    return f"size:{info.get('size')}"


def _tag(st: os.stat_result) -> str:
    return f"{st.st_ino}:{st.st_mtime_ns}:{st.st_size}"


@contextlib.contextmanager
def _http_status(where: str) -> Iterator[None]:
    """fsspec's http(s) store raises aiohttp's ClientResponseError for an error status (a 500, a PUT it
    refuses): not an OSError, which the callers map to a SinkError, so it came out as a traceback."""
    try:
        yield
    except Exception as e:
        if not type(e).__module__.startswith("aiohttp.") or isinstance(e, OSError):
            raise
        status, message = getattr(e, "status", None), getattr(e, "message", "")  # never its URL
        raise SinkError(f"{type(e).__name__}: HTTP {status} {message}".strip(), path=where) from None


@contextlib.contextmanager
def _locked(h: Held, name: str, tag: str) -> Iterator[bool]:
    """Hold an exclusive `flock` on the file `name` in `h` while it is still the file `tag` names: yields
    whether it is. Every replacer and deleter of a claim takes it, so a check and its change are one step."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=h.fd)
    except OSError:
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            same = (
                _tag(os.fstat(fd)) == tag and _tag(os.stat(name, dir_fd=h.fd, follow_symlinks=False)) == tag
            )
        except FileNotFoundError:
            same = False  # replaced or removed while we waited for the lock
        yield same
    finally:
        os.close(fd)


def _local_put_if(tree: LocalTree, key: str, data: bytes, tag: str | None) -> str | None:
    h, name = tree.parent(key, create=True)
    with h:
        tmp = temp_name(Path(name)).name  # names its host: a sweep there removes it once its writer is dead
        h.new_file(tmp, [memoryview(data)])
        crash_point("file.create")
        try:
            if tag is None:
                try:
                    h.link(tmp, name)  # cannot replace: exactly one creator wins
                except FileExistsError:
                    return None
            else:
                with _locked(h, name, tag) as same:
                    if not same:
                        return None
                    h.rename(tmp, name)  # a new inode: a replacer waiting on the old one then sees the change
            h.fsync()
            st = h.lstat(name)
            h.check()
            return None if st is None else _tag(st)
        finally:
            h.unlink(tmp)
