"""What a reader sees while `stagerd watch` is killed and restarted (test_injection.py): a thread that
polls ROOT and every sink and records anything partial, and the file listings the checks compare.

A reader may see an `export/` only whole or absent; a manifest, a tag, `latest` or the branch head only
ever naming a complete step; and a step directory leaving ROOT only once every sink holds it.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stagerd.contract import layout

HUB_REPO = "acme/crash"
Files = dict[str, tuple[int, str]]  # relative name -> (size, sha256 hex)
HUB_EXTRA = {"README.md", ".gitattributes"}  # the generated model card and the repo's own attributes


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def dir_files(d: Path, *, hidden: bool = True) -> Files:
    """Every file under `d`; without `hidden`, those whose name starts with a dot are left out before they
    are read: a temp name may be gone by then (see `dir_files_except_manifest`)."""
    return {
        str(p.relative_to(d)): (p.stat().st_size, sha256_file(p))
        for p in d.rglob("*")
        if (hidden or not p.name.startswith(".")) and p.is_file()
    }


# -- the reader that must never see a partial step ---------------------------------------------------------


@dataclass
class Sinks:
    """The sinks of one case, and how a reader reaches each."""

    file_dir: Path | None = None
    s3: Any = None  # tests.s3server.S3Env
    s3_prefix: str = "ckpt"
    hub: Any = None  # tests.hubserver.HubServer

    def urls(self) -> list[str]:
        out = []
        if self.file_dir is not None:
            out.append(self.file_dir.as_uri())
        if self.s3 is not None:
            out.append(self.s3.url(self.s3_prefix))
        if self.hub is not None:
            out.append(f"hf://{HUB_REPO}")
        return out


def compare(what: str, got: Files, want: Files) -> list[str]:
    """Differences between two file sets, by name, size and sha256 (sha256 only where `got` has one)."""
    problems = []
    if set(got) != set(want):
        problems.append(f"{what}: files {sorted(got)} != {sorted(want)}")
    for name in set(got) & set(want):
        (gs, gh), (ws, wh) = got[name], want[name]
        if gs != ws or (gh and gh != wh):
            problems.append(f"{what}/{name}: ({gs}, {gh[:12]}) != ({ws}, {wh[:12]})")
    return problems


class Reader(threading.Thread):
    """Polls ROOT and every sink as a consumer would, and records anything partial or lost it sees."""

    def __init__(self, root: Path, expected: dict[int, Files], sinks: Sinks) -> None:
        super().__init__(daemon=True)
        self.root, self.expected, self.sinks = root, expected, sinks
        self.violations: list[str] = []
        self.polls = 0
        self._halt = threading.Event()
        self._in_root: set[int] = set()
        self._hashed: set[int] = set()  # file:// steps whose bytes were hashed once already
        self._s3 = sinks.s3.server.client() if sinks.s3 is not None else None

    def run(self) -> None:
        while not self._halt.is_set():
            self.check()
            self._halt.wait(0.02)

    def stop(self) -> list[str]:
        self._halt.set()
        self.join(10)
        self.check()
        return self.violations

    def _bad(self, text: str) -> None:
        if text not in self.violations:
            self.violations.append(text)

    def check(self) -> None:
        try:
            self._check_root()
            self._check_file_sink()
            if self._s3 is not None and self.polls % 5 == 0:
                self._check_s3()
            self._check_hub()
        except Exception as e:  # a reader crash is a finding too, never a silent pass
            self._bad(f"reader error: {type(e).__name__}: {e}")
        self.polls += 1

    # ROOT: an export is whole or absent; a step leaves only once every sink holds it
    def _check_root(self) -> None:
        present = set()
        for step in self.expected:
            step_dir = self.root / layout.step_dir_name(step)
            if not step_dir.is_dir():
                continue
            present.add(step)
            export = step_dir / layout.EXPORT_DIR
            try:
                names = {p.name: (p.stat().st_size, "") for p in export.iterdir()}
            except FileNotFoundError:
                continue
            sizes = {k: (v[0], "") for k, v in self.expected[step].items()}
            for p in compare(f"ROOT step {step} export/", names, sizes):
                self._bad(p)
        for step in self._in_root - present:
            missing = [url for url, has in self._held(step).items() if not has]
            if missing:
                self._bad(f"step {step} left ROOT before it was published on {missing}")
        self._in_root = present

    def _held(self, step: int) -> dict[str, bool]:
        s, out = self.sinks, {}
        name = layout.step_dir_name(step)
        if s.file_dir is not None:
            out["file"] = (s.file_dir / name / layout.MANIFEST_NAME).is_file()
        if self._s3 is not None:
            key = f"{s.s3_prefix}/{name}/{layout.MANIFEST_NAME}"
            out["s3"] = bool(self._s3.list_objects_v2(Bucket=s.s3.bucket, Prefix=key).get("KeyCount"))
        if s.hub is not None:
            with s.hub.store.lock:
                repo = s.hub.store.repos.get(HUB_REPO)
                out["hub"] = repo is not None and f"step-{step}" in repo.tags
        return out

    # file://: a manifest names exactly the complete step; `latest` names a committed step
    def _check_file_sink(self) -> None:
        d = self.sinks.file_dir
        if d is None or not d.is_dir():
            return
        latest = d / "latest"
        if latest.exists():
            name = latest.read_text().strip()
            if not (d / name / layout.MANIFEST_NAME).is_file():
                self._bad(f"file:// latest names {name}, which has no manifest")
        for m in d.glob(f"step-*/{layout.MANIFEST_NAME}"):
            doc = json.loads(m.read_text())
            step = doc["step"]
            want = self.expected[step]
            listed = {f["path"]: (f["size"], f["sha256"]) for f in doc["files"]}
            for p in compare(f"file:// step {step} manifest", listed, want):
                self._bad(p)
            visible = {
                str(p.relative_to(m.parent)): (p.stat().st_size, "")
                for p in m.parent.rglob("*")
                if p.is_file() and p.name != layout.MANIFEST_NAME and not p.name.startswith(".")
            }
            for p in compare(f"file:// step {step}", visible, want):
                self._bad(p)
            if step not in self._hashed:
                self._hashed.add(step)
                for p in compare(f"file:// step {step} bytes", dir_files_except_manifest(m.parent), want):
                    self._bad(p)

    # S3: the same contract through a listing, as a consumer of the bucket sees it
    def _check_s3(self) -> None:
        s = self.sinks
        base = f"{s.s3_prefix}/"
        objects = s.s3.keys(base)
        if f"{base}latest" in objects:
            name = s.s3.get(f"{base}latest").decode().strip()
            manifest = f"{base}{name}/{layout.MANIFEST_NAME}"
            # `latest` is read after the listing: a manifest and `latest` written in between are absent
            # from the listing, so only a listing made after reading `latest` can prove a violation.
            if manifest not in objects and manifest not in s.s3.keys(manifest):
                self._bad(f"s3 latest names {name}, which has no manifest")
        for key in objects:
            if not key.endswith(f"/{layout.MANIFEST_NAME}"):
                continue
            step_prefix = key[: -len(layout.MANIFEST_NAME)]
            doc = json.loads(s.s3.get(key))
            step = doc["step"]
            listed = {f["path"]: (f["size"], f["sha256"]) for f in doc["files"]}
            for p in compare(f"s3 step {step} manifest", listed, self.expected[step]):
                self._bad(p)
            visible = {
                k[len(step_prefix) :]: (size, "")
                for k, size in objects.items()
                if k.startswith(step_prefix) and k != key
            }
            for p in compare(f"s3 step {step}", visible, self.expected[step]):
                self._bad(p)

    # Hub: every stagerd commit, every tag and the branch head hold one complete step
    def _check_hub(self) -> None:
        hub = self.sinks.hub
        if hub is None:
            return
        with hub.store.lock:
            repo = hub.store.repos.get(HUB_REPO)
            if repo is None:
                return
            commits = list(repo.commits.values())
            tags = dict(repo.tags)
            head = repo.commits[repo.branches["main"]]
        by_oid = {c.oid: c for c in commits}
        for c in commits:
            if c.title.startswith("stagerd: step "):
                step = int(c.title.rsplit(" ", 1)[1])
                for p in compare(
                    f"hub commit {c.oid[:8]} ({c.title})", hub_files(hub, c), self.expected[step]
                ):
                    self._bad(p)
        for tag, oid in tags.items():
            title = by_oid[oid].title
            if title != f"stagerd: step {tag.removeprefix('step-')}":
                self._bad(f"hub tag {tag} points at {title!r}")
        if head.title != "initial commit" and not head.title.startswith("stagerd: step "):
            self._bad(f"hub main head is {head.title!r}")


def dir_files_except_manifest(d: Path) -> Files:
    """A published step as a reader takes it: every file but the manifest and hidden temp names. The reader
    lists a step once its manifest is there, while a writer may still remove a temp name in it (the sink
    links the manifest from its temp name, then unlinks that): a temp name is never stat'ed or read."""
    files = dir_files(d, hidden=False)
    files.pop(layout.MANIFEST_NAME, None)
    return files


def hub_files(hub: Any, commit: Any) -> Files:
    """The export files of a commit, with the sha256 of the bytes the server holds (LFS or inline)."""
    out = {}
    for path, blob in commit.tree.items():
        if path in HUB_EXTRA:
            continue
        if blob.is_lfs:
            out[path] = (blob.size, sha256_file(hub.store.lfs_path(blob.sha256)))
        else:
            out[path] = (blob.size, hashlib.sha256(blob.content).hexdigest())
    return out
