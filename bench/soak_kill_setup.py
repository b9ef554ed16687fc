"""The crash soak's run (`bench/soak_kill.py`): ROOT, the two sinks and the sentinels beside and under their
prefix, the steps committed, and what the sinks' manifests were when first seen."""

from __future__ import annotations

import contextlib
import hashlib
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stagerd.contract import layout
from stagerd.daemon.journal import Journal
from tests.cli_helpers import STAGERD, clean_env
from tests.daemon.crash.test_injection import big_tensors, stage
from tests.daemon_helpers import fast_flags
from tests.dcp_fixtures import dcp_save

PREFIX = "run1"
# Beside the prefix (a literal prefix, so `run10/` and `run1-old/` are other trees) and under it (a directory
# that is no step, a step directory no stagerd published: no manifest, no claim).
SENTINELS = {
    "run10/step-00000001/model.safetensors": b"another run's step",
    "run10/latest": b"step-00000001\n",
    "run1-old/latest": b"step-00000007\n",
    "run1-old/step-00000007/stagerd.manifest.json": b"{}",
    f"{PREFIX}/notes/readme.txt": b"a person's notes",
    f"{PREFIX}/step-00000000/foreign.bin": b"not stagerd's",
}
S3_ONLY = {"run1x": b"a key that shares the prefix's letters", "run1": b"a key named as the prefix"}
ROOT_SENTINELS = {"notes.txt": b"the trainer's notes", "other-run/step-00000001/x.bin": b"not a step of ROOT"}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tree(d: Path) -> dict[str, tuple[int, str]]:
    return {
        str(p.relative_to(d)): (p.stat().st_size, sha(p.read_bytes())) for p in d.rglob("*") if p.is_file()
    }


@dataclass
class Soak:
    work: Path
    root: Path
    fsink: Path  # the file:// sink's base: the sink is fsink/PREFIX
    models: list[Path]
    s3: Any  # tests.s3server.S3TestServer
    bucket: str
    keep_last: int
    remote_keep_last: int
    env: dict[str, str]
    last_step: int = 0
    workers: int = 1
    hub: Any = None  # soak_kill_hub.HubSide, when the run has a Hub sink
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _inodes: dict[str, int] = field(default_factory=dict)
    _etags: dict[str, tuple[str, Any]] = field(default_factory=dict)  # S3 sentinel -> (ETag, LastModified)
    # each manifest as first seen after a kill: (sink, step) -> its version (file:// inode and bytes, S3 ETag
    # and LastModified); a published step's manifest is never written again
    manifests: dict[tuple[str, int], Any] = field(default_factory=dict)

    @classmethod
    def create(cls, work: Path, s3: Any, bucket: str, keep_last: int, remote_keep_last: int) -> Soak:
        models = [work / "model-small", work / "model-big"]
        if not models[0].is_dir():
            dcp_save(models[0], world=2)
        if not models[1].is_dir():
            dcp_save(models[1], world=2, builder=big_tensors)
        env = clean_env(
            dict(
                **s3.aws_env(work / "absent"),
                STAGERD_RETRY_BASE_SECONDS="0.1",
                STAGERD_RETRY_MAX_SECONDS="1",
                STAGERD_MAX_ATTEMPTS="10000",
            )
        )
        soak = cls(work, work / "root", work / "fsink", models, s3, bucket, keep_last, remote_keep_last, env)
        soak.root.mkdir()
        client = s3.client()
        client.create_bucket(Bucket=bucket)
        for key, data in {**SENTINELS, **S3_ONLY}.items():
            client.put_object(Bucket=bucket, Key=key, Body=data)
            head = client.head_object(Bucket=bucket, Key=key)
            soak._etags[key] = (head["ETag"], head["LastModified"])
        for base, items in ((soak.fsink, SENTINELS), (soak.root, ROOT_SENTINELS)):
            for rel, data in items.items():
                (base / rel).parent.mkdir(parents=True, exist_ok=True)
                (base / rel).write_bytes(data)
                soak._inodes[str(base / rel)] = (base / rel).stat().st_ino
        return soak

    @property
    def sink_urls(self) -> list[str]:
        urls = [(self.fsink / PREFIX).as_uri(), f"s3://{self.bucket}/{PREFIX}"]
        return urls + ([self.hub.url] if self.hub is not None else [])

    def add_hub(self, hub: Any) -> None:
        self.hub = hub
        self.env.update(hub.env)

    def watch_cmd(self) -> list[str]:
        cmd = [*STAGERD, "watch", str(self.root), *fast_flags(), "--keep-last", str(self.keep_last)]
        cmd += ["--remote-keep-last", str(self.remote_keep_last)]
        cmd += ["--export-workers", str(self.workers), "--publish-workers", str(self.workers)]
        for url in self.sink_urls:
            cmd += ["--sink", url]
        return cmd

    def model_of(self, step: int) -> Path:
        return self.models[step % 2]

    def commit_next(self) -> int:
        """Commit the next step in ROOT: a copy of one of the two saves, its extras naming the step."""
        with self._lock:
            self.last_step += 1
            step = self.last_step
            stage(self.root, step, self.model_of(step))
            return step

    def note_manifests(self) -> None:
        """Record every manifest now on the sinks, where not seen before (`check_manifests` compares)."""
        for m in (self.fsink / PREFIX).glob(f"step-*/{layout.MANIFEST_NAME}"):
            with contextlib.suppress(FileNotFoundError):  # pruned meanwhile
                version = (m.stat().st_ino, m.read_bytes())
                self.manifests.setdefault(("file", layout.parse_step_dir(m.parent.name) or 0), version)
        for key, version in s3_manifests(self).items():
            self.manifests.setdefault(("s3", key), version)

    def all_done(self) -> bool:
        """Every committed step is published on every sink (or retired) and retention has caught up."""
        try:
            j = Journal.open_readonly(self.root)
        except Exception:
            return False
        try:
            rows = j.steps()
            lanes = j.lanes(include_retired=False)
        finally:
            j.close()
        states = {r.step: str(r.state) for r in rows}
        if set(states) != set(range(1, self.last_step + 1)):
            return False
        if any(s not in ("published", "retired") for s in states.values()):
            return False
        if any(str(ln.state) != "published" for ln in lanes):
            return False
        return sum(s == "published" for s in states.values()) <= self.keep_last


def s3_manifests(soak: Soak) -> dict[int, tuple[str, Any]]:
    client = soak.s3.client()
    out = {}
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=soak.bucket, Prefix=f"{PREFIX}/step-")
    for page in pages:
        for o in page.get("Contents", []):
            if o["Key"].endswith("/" + layout.MANIFEST_NAME):
                step = layout.parse_step_dir(o["Key"].split("/")[1]) or 0
                out[step] = (o["ETag"], o["LastModified"])
    return out
