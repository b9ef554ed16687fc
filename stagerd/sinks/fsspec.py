"""The fsspec sink: `s3://BUCKET/PREFIX`, `file:///PATH`, and any other fsspec URL.

Remote layout, per step:

    PREFIX/step-00000100/<export files>          large files as parallel multipart (S3)
    PREFIX/step-00000100/stagerd.manifest.json   written LAST, with If-None-Match: *; it is the commit
    PREFIX/latest                                 the name of the newest published step dir

A step without a manifest is absent to a reader. A re-run after a crash replaces only what is missing or
differs (judged by size and the store's checksum where it has one), never writes a second manifest that
differs from the first, and raises `SinkConflictError` if the remote manifest disagrees with the export.
On S3 a fresh sink sends files under two parts create-only (`If-None-Match: *`) beside the step's first
listing: on a re-run after a restart those that landed before are sent again and refused, never written.

Three backends share this one publish algorithm: S3 (`s3/backend.py`: async, parallel multipart with per-part
checksums, on s3fs's event loop), the local filesystem (`local.py`: fsync'd, exclusive manifest by `link`),
and any other fsspec filesystem (`generic.py`: sequential, best effort `exists` then write for the manifest).
What they share is in `objects.py`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from stagerd.contract import layout
from stagerd.contract.manifest import MAX_MANIFEST_BYTES, ExportManifest, ManifestFile
from stagerd.contract.step.held import HeldDir
from stagerd.errors import SinkAuthError, SinkConflictError, SinkError, VerifyError
from stagerd.ops.crashpoints import crash_point, delay_point
from stagerd.sinks.backends import open_backend
from stagerd.sinks.base import ProgressFn, PublishResult
from stagerd.sinks.claims import check_same, claim_key, claimed_error, owned_by, publish_claim
from stagerd.sinks.denied import denied_hint
from stagerd.sinks.fetch import RAW_DIR, node_part
from stagerd.sinks.latest import LatestMixin
from stagerd.sinks.local import LocalBackend
from stagerd.sinks.objects import (
    MAX_CLAIM_BYTES,
    Backend,
    BatchingStore,
    ByteProgress,
    Claiming,
    LocalFile,
    RemoteObject,
    StepOpening,
    Uploaded,
    manifest_bytes,
    parse_manifest,
    plan_reuse,
    redact_url,
    same_checksum,
    scan_dir,
    verify_listing,
)
from stagerd.sinks.raw_step import held_raw_step

log = logging.getLogger("stagerd.sinks.fsspec")
_MANIFEST = MAX_MANIFEST_BYTES + 1  # read of a manifest: one past the limit, which parse_manifest refuses


class FsspecSink(LatestMixin):
    """Publishes steps to `PREFIX/step-XXXXXXXX/` on any fsspec store, the manifest last."""

    def __init__(self, url: str, backend: Backend) -> None:
        self.url = redact_url(url.rstrip("/"))
        self._backend = backend
        # keys this sink created early in a step another publisher holds, kept until its manifest says
        # which of them it names (`_discard`)
        self._strays: dict[str, list[tuple[str, str | None]]] = {}

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        part_size: int = 16 << 20,
        max_concurrency: int = 8,
        checksum: str = "CRC32",
        **options: Any,
    ) -> FsspecSink:
        """Open the store behind `url`. `storage_options` go to the fsspec filesystem (s3fs: `key`,
        `secret`, `endpoint_url`, `profile`, `client_kwargs`, `config_kwargs`...); the AWS environment
        and config files apply to S3 as usual. S3 only: `part_size` and `max_concurrency` (parts in
        flight, so memory is about their product), `checksum` (CRC32 or SHA256) the store verifies."""
        opts = {**dict(storage_options or {}), **options}
        backend = open_backend(
            url, opts, part_size=part_size, max_concurrency=max_concurrency, checksum=checksum
        )
        return cls(url, backend)

    # -- Sink protocol -----------------------------------------------------------------------------------

    def publish(
        self,
        export_dir: Path,
        step: int,
        *,
        metadata: Mapping[str, Any] | None = None,
        progress: ProgressFn | None = None,
    ) -> PublishResult:
        """Upload `export_dir` as `step`, verify it, commit its manifest, move `latest`."""
        export_dir = Path(export_dir)
        files = scan_dir(export_dir)
        return self._publish_tree(files, layout.step_dir_name(step), step, metadata, progress, export_dir)

    def publish_raw(
        self, step_dir: Path | HeldDir, step: int, *, progress: ProgressFn | None = None
    ) -> PublishResult:
        """Publish the raw staged step (DCP shards, `optim/`, extras, commit marker) under
        `PREFIX/raw/step-XXXXXXXX/` for resume, separately from the HF export.

        Exactly the files the commit marker lists, and the marker: never `export/` or what the daemon
        writes beside it, so the raw manifest is the same whether it is sent before or after the export.
        Each is read through handles held from the step directory (`raw_step.py`), the caller's if given."""
        with held_raw_step(step_dir) as (marker, files, local_root):
            prefix = f"{RAW_DIR}/{layout.step_dir_name(step)}"
            nodes = getattr(marker, "staging_nodes", 1)
            if nodes > 1:  # each staging node holds only its own shards: one raw tree per node
                prefix = f"{prefix}/{node_part(marker.staging_node, nodes)}"
            return self._publish_tree(files, prefix, step, {"raw": True}, progress, local_root)

    def is_published(self, step: int) -> bool:
        """True when the step's manifest exists and the listing matches it by name and size."""
        prefix = layout.step_dir_name(step)
        data = self._call(lambda: self._backend.read(f"{prefix}/{layout.MANIFEST_NAME}", _MANIFEST), prefix)
        if data is None:
            return False
        manifest = parse_manifest(data, self._where(prefix, layout.MANIFEST_NAME))
        remote = self._call(lambda: self._backend.list(prefix), prefix)
        return manifest.step == step and not verify_listing(manifest, remote, {})

    def close(self) -> None:
        self._backend.close()

    @property
    def backend(self) -> Backend:
        """The store under this sink: the fleet uploads its files and writes its records through it."""
        return self._backend

    def commit_uploaded(
        self, step: int, digests: list[Uploaded], metadata: Mapping[str, Any] | None = None
    ) -> bool:
        """Commit a step whose files were uploaded by others (the fleet's owners): verify the listing and
        every store checksum against `digests`, create the manifest last, then `settle` it. False when the
        step already had this very manifest."""
        prefix = layout.step_dir_name(step)
        key = f"{prefix}/{layout.MANIFEST_NAME}"
        manifest = self._manifest(step, digests, metadata)
        self._verify(prefix, manifest, {d.rel: d.checksum for d in digests})
        b = self._backend
        crash_point("fleet.commit")
        created = self._call(lambda: b.create(key, manifest_bytes(manifest)), key)
        if not created:
            raw = self._call(lambda: b.read(key, _MANIFEST), key) or b""
            check_same(parse_manifest(raw, self._where(key)), manifest, self._where(key))
        crash_point("fleet.manifest")
        self.settle(step)
        return bool(created)

    def settle(self, step: int) -> None:
        """A committed fleet step: `latest` moved to it, then what a killed owner left under it swept (its
        pending multipart uploads, its temp files, on any host): no owner writes there once it is
        committed. The leader's restart after its manifest comes here too, or they stay for ever."""
        prefix = layout.step_dir_name(step)
        self._move_latest(prefix, step)
        self._call(lambda: self._backend.sweep(prefix, settled=True), prefix)

    # -- the algorithm -----------------------------------------------------------------------------------

    def _publish_tree(
        self,
        files: list[LocalFile],
        prefix: str,
        step: int,
        metadata: Mapping[str, Any] | None,
        progress: ProgressFn | None,
        local_root: Path,
    ) -> PublishResult:
        t0 = time.monotonic()
        if not files:
            raise VerifyError("has no files to publish", path=local_root)
        b = self._backend
        manifest_key = f"{prefix}/{layout.MANIFEST_NAME}"
        total = sum(f.size for f in files)
        prog = ByteProgress(total, progress)

        if isinstance(b, LocalBackend):
            # before the claim: nothing written for a step linked elsewhere
            self._call(lambda: b.refuse_links(manifest_key), manifest_key)
        mine = publish_claim(local_root)
        claim = Claiming(claim_key(prefix), mine.encode(), lambda data: owned_by(data, mine))
        opening = self._open_step(prefix, manifest_key, files, prog, claim)
        delay_point("publish.opened")
        early = {d.rel: d for d in [*opening.created, *opening.refused]}  # hashed while opening
        if opening.existing is not None:
            remote_manifest = parse_manifest(opening.existing, self._where(manifest_key))
            digests = [early.get(f.rel) or b.digest(f) for f in files]
            try:
                ours = self._manifest(step, digests, metadata)
                where = self._where(manifest_key)
                check_same(remote_manifest, ours, where, None if opening.claimed else opening.claim)
            except SinkConflictError:
                self._discard(prefix, opening, remote_manifest)
                raise
            self._verify(prefix, remote_manifest, {d.rel: d.checksum for d in digests})
            self._strays.pop(prefix, None)  # the same files as ours: every key we created is named
            self._move_latest(prefix, step)
            log.info("step %d already on %s", step, self.url, extra={"step": step, "sink": self.url})
            return self._result(prefix, step, files, 0, True, t0)
        if not opening.claimed:  # another publisher (or a prune) holds the step: change nothing
            self._discard(prefix, opening, None)
            raise claimed_error(self._where(claim.key), opening.claim, step)
        self._strays.pop(prefix, None)  # ours now (a prune gave the step back): we replace what is there

        created = {d.rel: d for d in opening.created}
        listed = opening.listed
        if listed is None and all(f.rel in created for f in files):
            listed = {}  # every file was created while opening: nothing listed could be reused
        remote = listed if listed is not None else self._call(lambda: b.list(prefix), prefix)
        refused = {d.rel: d for d in opening.refused}
        reused: dict[str, Uploaded] = {}
        same_size = [
            f.rel for f in files if f.rel not in created and f.rel in remote and remote[f.rel].size == f.size
        ]
        if b.has_checksums and same_size:
            have = self._call(lambda: b.checksums(prefix, same_size), prefix)
            remote = {k: RemoteObject(v.size, have.get(k, v.checksum)) for k, v in remote.items()}
            for f in plan_reuse([f for f in files if f.rel in have], remote):
                d = refused.get(f.rel) or b.digest(f)
                if same_checksum(remote[f.rel].checksum, d.checksum):
                    reused[f.rel] = dataclasses.replace(d, confirmed=True)  # the store's HEAD, just now
                    prog(f.size)
        for rel in sorted(r for r in set(refused) - set(reused) if r in remote):  # not a 501's refusal
            log.warning(
                "%s already holds other bytes than the export's %s; the step is not published, so they are "
                "replaced",
                self._where(prefix, rel),
                rel,
                extra={"step": step, "sink": self.url},
            )
        todo = [f for f in files if f.rel not in reused and f.rel not in created]
        uploaded = self._call(lambda: b.upload(prefix, todo, prog), prefix) if todo else []
        digests = sorted([*reused.values(), *created.values(), *uploaded], key=lambda d: d.rel)
        manifest = self._manifest(step, digests, metadata)
        confirmed = {d.rel for d in digests if d.confirmed}
        self._verify(prefix, manifest, {d.rel: d.checksum for d in digests}, confirmed)

        created_manifest = self._call(lambda: b.create(manifest_key, manifest_bytes(manifest)), manifest_key)
        if not created_manifest:
            # the step was published before (a listing was skipped or raced): by another publisher, or
            # by this one before a restart
            raw = self._call(lambda: b.read(manifest_key, _MANIFEST), manifest_key) or b""
            other = parse_manifest(raw, self._where(manifest_key))
            try:
                check_same(other, manifest, self._where(manifest_key))
            except SinkConflictError:
                self._discard(prefix, opening, other)
                raise
        crash_point("fsspec.manifest")
        self._move_latest(prefix, step)
        sent = sum(f.size for f in todo) + sum(d.size for d in created.values())
        log.info(
            "published step %d to %s: %d files, %d bytes uploaded, %d reused",
            step,
            self.url,
            len(files),
            sent,
            len(reused),
            extra={"step": step, "sink": self.url},
        )
        return self._result(prefix, step, files, sent, False, t0)

    def _manifest(
        self, step: int, digests: list[Uploaded], metadata: Mapping[str, Any] | None
    ) -> ExportManifest:
        return ExportManifest(
            step=step,
            files=tuple(ManifestFile(d.rel, d.size, d.sha256) for d in sorted(digests, key=lambda d: d.rel)),
            metadata=dict(metadata or {}),
        )

    def _open_step(
        self, prefix: str, manifest_key: str, files: list[LocalFile], progress: ByteProgress, claim: Claiming
    ) -> StepOpening:
        """The step's claim (`claims.py`), then its manifest if it has one; the prefix is swept only by the
        claim's holder. A batching store also lists the step, reads `latest` and creates what it can
        without overwriting, in the same round trip as the claim."""
        b = self._backend
        if isinstance(b, BatchingStore):
            opener, latest_key = b, self._latest_key(prefix)
            opening: StepOpening = self._call(
                lambda: opener.open_step(prefix, manifest_key, latest_key, files, progress, claim), prefix
            )
            return opening
        claimed = self._call(lambda: b.create(claim.key, claim.data), claim.key)
        held = None
        if not claimed:
            held = self._call(lambda: b.read(claim.key, MAX_CLAIM_BYTES + 1), claim.key)
            claimed = claim.owns(held)
        # read after the claim settled
        existing = self._call(lambda: b.read(manifest_key, _MANIFEST), manifest_key)
        if claimed:
            self._call(lambda: b.sweep(prefix), prefix)
        return StepOpening(existing, None, [], [], claimed, held)

    def _discard(self, prefix: str, opening: StepOpening, published: ExportManifest | None) -> None:
        """Remove what this publish created early in a step that another publisher holds: its create-only
        PUTs wrote only keys that were free, and each is deleted only while it still holds the version
        this publish wrote. Only once the step's manifest is there (`published`), and only keys it does not
        name: until then the holder may keep any of them, because an object of the same bytes has the same
        ETag (its PUT of that file was refused, or it rewrote the same bytes), and a delete then would
        remove a file its manifest names. Until then they are remembered, for a retry that finds it."""
        created = [(f"{prefix}/{d.rel}", d.etag) for d in opening.created]
        held = [*self._strays.pop(prefix, []), *created]
        if published is None:
            if held:
                self._strays[prefix] = held
            return
        listed = {f"{prefix}/{f.path}" for f in published.files}
        stray = [(key, etag) for key, etag in held if key not in listed]
        b = self._backend
        if stray and isinstance(b, BatchingStore):
            batching = b
            self._call(lambda: batching.discard(stray), prefix)

    def _verify(
        self,
        prefix: str,
        manifest: ExportManifest,
        expected: Mapping[str, str | None],
        confirmed: set[str] | frozenset[str] = frozenset(),
    ) -> None:
        """The listing against the manifest: names and sizes, and the store's checksum of every file whose
        checksum was not `confirmed` by the store's own answer during the upload."""
        b = self._backend
        ask = [f.path for f in manifest.files if f.path not in confirmed]
        if not ask:
            return  # the store's answers during this publish confirmed every file's checksum already
        remote = self._call(lambda: b.list(prefix), prefix)
        if b.has_checksums and ask:
            have = self._call(lambda: b.checksums(prefix, ask), prefix)
            remote = {k: RemoteObject(v.size, have.get(k, v.checksum)) for k, v in remote.items()}
        problems = verify_listing(manifest, remote, expected)
        if problems:
            raise SinkError(
                f"verification failed after upload: {'; '.join(problems[:5])}"
                + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""),
                path=self._where(prefix),
            )

    def _result(
        self, prefix: str, step: int, files: list[LocalFile], sent: int, skipped: bool, t0: float
    ) -> PublishResult:
        return PublishResult(
            sink=self.url,
            step=step,
            location=self._where(prefix),
            files=len(files),
            bytes_total=sum(f.size for f in files),
            bytes_uploaded=sent,
            skipped=skipped,
            seconds=time.monotonic() - t0,
        )

    def _where(self, *parts: str) -> str:
        return "/".join([self.url, *parts])

    def _call(self, fn: Callable[[], Any], key: str) -> Any:
        """Run one backend operation; turn OS-level failures into named sink errors naming the file."""
        try:
            return fn()
        except SinkError:
            raise
        except PermissionError as e:
            raise SinkAuthError(
                f"permission denied: {e.strerror or e}", path=self._where(key), hint=denied_hint(self.url)
            ) from None
        except OSError as e:
            raise SinkError(f"{type(e).__name__}: {e.strerror or e}", path=self._where(key)) from None
