"""The crash soak's invariants (`check_all`), checked once a clean daemon has settled the run.

- the journal opens (SQLite integrity_check says ok) and `stagerd status ROOT` exits 0; every committed
  step is in it, the newest `--keep-last` `published`, the others `retired`; each step and each of its
  lanes recorded `published` exactly once; no sink's manifest written again after it was first seen;
- ROOT holds exactly those newest steps, each with a whole `export/`, and nothing stagerd left behind
  (no `export.tmp/`, no trash entry, no set-aside or temp name, no step lock file, nothing else in ROOT
  or `.stagerd/` but the journal, its lock and root id); ROOT's sentinels are untouched;
- each sink holds, complete (its manifest there), exactly the newest `--remote-keep-last` steps; each
  byte-identical (every file but the manifest) to a clean `stagerd consolidate` of that step, and accepted
  by `stagerd verify --against` the step; `latest` names the newest step;
- each sink holds nothing else under the prefix but the claims of its steps and the sentinels there (no
  temp name, no pending multipart upload, no orphan file or empty directory of a pruned step); every
  sentinel beside and under the prefix is byte-identical (and, on file://, the same inode; on S3, the same
  ETag and LastModified) as placed.
"""

from __future__ import annotations

import sqlite3
import subprocess
from pathlib import Path
from typing import Any

from soak_kill_setup import PREFIX, ROOT_SENTINELS, S3_ONLY, SENTINELS, Soak, s3_manifests, sha, tree

from stagerd.contract import layout
from stagerd.daemon.journal import Journal
from tests.cli_helpers import STAGERD
from tests.daemon.crash.test_injection import stage
from tests.daemon_helpers import REPO


def run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([*STAGERD, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)


def check_all(soak: Soak) -> list[str]:
    fails: list[str] = []
    fails += check_journal(soak)
    fails += check_once(soak)
    fails += check_root(soak)
    ref = reference_exports(soak)
    fails += check_file_sink(soak, ref)
    fails += check_s3_sink(soak, ref)
    return fails


def check_journal(soak: Soak) -> list[str]:
    fails = []
    path = soak.root / layout.STATE_DIR / "journal.sqlite"
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        ok = con.execute("PRAGMA integrity_check").fetchone()[0]
        if ok != "ok":
            fails.append(f"journal integrity_check: {ok}")
    finally:
        con.close()
    r = run("status", str(soak.root), env=soak.env)
    if r.returncode != 0:
        fails.append(f"stagerd status exited {r.returncode}: {r.stderr[-2000:]}")
    j = Journal.open_readonly(soak.root)
    try:
        states = {r.step: str(r.state) for r in j.steps()}
    finally:
        j.close()
    newest = set(range(soak.last_step - soak.keep_last + 1, soak.last_step + 1))
    want = {s: "published" if s in newest else "retired" for s in range(1, soak.last_step + 1)}
    if states != want:
        diff = {
            s: (states.get(s), want.get(s)) for s in set(states) | set(want) if states.get(s) != want.get(s)
        }
        fails.append(f"journal states (got, want): {diff}")
    return fails


def check_once(soak: Soak) -> list[str]:
    """Each step, and each of its lanes, recorded `published` exactly once; no manifest written twice."""
    j = Journal.open_readonly(soak.root)
    try:
        events = [e for e in j.events() if e.to_state == "published"]
    finally:
        j.close()
    counts: dict[tuple[int, str | None], int] = {}
    for e in events:
        counts[(e.step, e.sink)] = counts.get((e.step, e.sink), 0) + 1
    want = {(s, u): 1 for s in range(1, soak.last_step + 1) for u in [None, *soak.sink_urls]}
    fails = []
    if counts != want:
        diff = {k: counts.get(k) for k in {*counts, *want} if counts.get(k) != want.get(k)}
        fails.append(f"`published` events not once per step and lane: {dict(sorted(diff.items())[:10])}")
    soak.note_manifests()
    now: dict[tuple[str, int], Any] = {}
    for m in (soak.fsink / PREFIX).glob(f"step-*/{layout.MANIFEST_NAME}"):
        now[("file", layout.parse_step_dir(m.parent.name) or 0)] = (m.stat().st_ino, m.read_bytes())
    now.update({("s3", s): v for s, v in s3_manifests(soak).items()})
    rewritten = sorted(k for k, v in now.items() if soak.manifests.get(k) != v)
    if rewritten:
        fails.append(f"manifests written again after a kill: {rewritten[:10]}")
    return fails


def check_root(soak: Soak) -> list[str]:
    fails = []
    newest = range(soak.last_step - soak.keep_last + 1, soak.last_step + 1)
    dirs = sorted(p.name for p in soak.root.iterdir() if p.name.startswith("step-"))
    if dirs != [layout.step_dir_name(s) for s in newest]:
        fails.append(f"ROOT step dirs {dirs}, want the newest {soak.keep_last}")
    for s in newest:
        d = soak.root / layout.step_dir_name(s)
        if (
            not (d / layout.EXPORT_DIR / "model.safetensors.index.json").exists()
            and not (d / layout.EXPORT_DIR / "model.safetensors").exists()
        ):
            fails.append(f"{d}: no whole export")
    odd = []
    for p in soak.root.rglob("*"):
        rel = str(p.relative_to(soak.root))
        if layout.EXPORT_TMP_DIR in p.parts or ".tmp" in p.name or ".retired." in p.name:
            odd.append(rel)
        if p.parent == soak.root / layout.STATE_DIR / "trash":
            odd.append(rel)
    top = {
        layout.STATE_DIR,
        *(layout.step_dir_name(s) for s in newest),
        *(r.split("/")[0] for r in ROOT_SENTINELS),
    }
    odd += [p.name for p in soak.root.iterdir() if p.name not in top]  # a step lock file left, say
    state = {"journal.sqlite", "journal.sqlite-wal", "journal.sqlite-shm", "fleet-root-id", "lock", "trash"}
    odd += [
        f"{layout.STATE_DIR}/{p.name}"
        for p in (soak.root / layout.STATE_DIR).iterdir()
        if p.name not in state
    ]
    if odd:
        fails.append(f"ROOT leftovers: {sorted(odd)[:20]}")
    fails += sentinels_intact(soak, soak.root, ROOT_SENTINELS)
    return fails


def sentinels_intact(soak: Soak, base: Path, items: dict[str, bytes]) -> list[str]:
    fails = []
    for rel, data in items.items():
        p = base / rel
        if not p.is_file() or p.read_bytes() != data or p.stat().st_ino != soak._inodes[str(p)]:
            fails.append(f"sentinel {p} deleted or rewritten")
    return fails


def reference_exports(soak: Soak, steps: list[int] | None = None) -> dict[int, Path]:
    """Each step the sinks should hold (or `steps`), staged again and consolidated cleanly: step -> export."""
    out = {}
    for s in kept_on_sinks(soak) if steps is None else steps:
        ref_root = soak.work / "ref"
        step_dir = ref_root / layout.step_dir_name(s)
        exp = soak.work / "ref-export" / layout.step_dir_name(s)
        if not exp.exists():
            if not step_dir.exists():
                stage(ref_root, s, soak.model_of(s))
            exp.parent.mkdir(exist_ok=True)
            r = run("consolidate", str(step_dir), str(exp), env=soak.env)
            if r.returncode != 0:
                raise RuntimeError(f"reference consolidate of step {s}: {r.stderr[-2000:]}")
        out[s] = exp
    return out


def kept_on_sinks(soak: Soak) -> list[int]:
    return list(range(max(1, soak.last_step - soak.remote_keep_last + 1), soak.last_step + 1))


def verify_copy(soak: Soak, copy: Path, step: int) -> list[str]:
    step_dir = soak.work / "ref" / layout.step_dir_name(step)
    r = run("verify", str(copy), "--against", str(step_dir), env=soak.env)
    return [] if r.returncode == 0 else [f"stagerd verify {copy}: {r.stdout[-500:]} {r.stderr[-1500:]}"]


def check_file_sink(soak: Soak, ref: dict[int, Path]) -> list[str]:
    fails = []
    sink = soak.fsink / PREFIX
    kept = kept_on_sinks(soak)
    complete = sorted(int(m.parent.name.split("-")[1]) for m in sink.glob(f"step-*/{layout.MANIFEST_NAME}"))
    if complete != kept:
        fails.append(f"file sink: complete steps {complete}, want {kept}")
    for s in kept:
        d = sink / layout.step_dir_name(s)
        if not d.is_dir():
            continue
        got = {k: v for k, v in tree(d).items() if k != layout.MANIFEST_NAME}
        if got != tree(ref[s]):
            fails.append(f"file sink step {s}: differs from a clean consolidate: {got} vs {tree(ref[s])}")
        fails += verify_copy(soak, d, s)
    latest = (sink / "latest").read_text().strip() if (sink / "latest").exists() else None
    if latest != layout.step_dir_name(soak.last_step):
        fails.append(f"file sink latest {latest!r}, want step {soak.last_step}")
    allowed = {"latest", "notes/readme.txt", "step-00000000/foreign.bin"}
    allowed |= {f"{layout.step_dir_name(s)}/{f}" for s in kept for f in [*tree(ref[s]), layout.MANIFEST_NAME]}
    extra = sorted(k for k in tree(sink) if k not in allowed and not k.startswith("claims/"))
    extra += sorted(
        f"{p.relative_to(sink)}/ (empty)" for p in sink.rglob("*") if p.is_dir() and not any(p.iterdir())
    )
    if extra:
        fails.append(f"file sink: unexpected files under the prefix: {extra[:20]}")
    claims = sorted(k for k in tree(sink) if k.startswith("claims/"))
    want_claims = [f"claims/{layout.step_dir_name(s)}" for s in kept]
    if claims and claims != want_claims:
        fails.append(f"file sink claims {claims}, want {want_claims}")
    fails += sentinels_intact(soak, soak.fsink, SENTINELS)
    return fails


def check_s3_sink(soak: Soak, ref: dict[int, Path]) -> list[str]:
    fails = []
    client = soak.s3.client()
    keys: dict[str, int] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=soak.bucket):
        keys.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})

    def get(key: str) -> bytes:
        return client.get_object(Bucket=soak.bucket, Key=key)["Body"].read()

    for key, data in {**SENTINELS, **S3_ONLY}.items():
        if key not in keys or get(key) != data:
            fails.append(f"S3 sentinel {key} deleted or rewritten")
            continue
        head = client.head_object(Bucket=soak.bucket, Key=key)
        if (head["ETag"], head["LastModified"]) != soak._etags[key]:
            fails.append(f"S3 sentinel {key} written again (same bytes)")
    base = f"{PREFIX}/"
    kept = kept_on_sinks(soak)
    complete = sorted(
        int(k[len(base) :].split("/")[0].split("-")[1])
        for k in keys
        if k.startswith(base + "step-") and k.endswith("/" + layout.MANIFEST_NAME)
    )
    if complete != kept:
        fails.append(f"S3 sink: complete steps {complete}, want {kept}")
    for s in kept:
        name = layout.step_dir_name(s)
        want = tree(ref[s])
        got = {}
        for rel in want:
            key = f"{base}{name}/{rel}"
            if key in keys:
                data = get(key)
                got[rel] = (len(data), sha(data))
        if got != want:
            fails.append(f"S3 step {s}: differs from a clean consolidate")
            continue
        copy = soak.work / "s3-copy" / name
        if not copy.exists():
            for rel in want:
                (copy / rel).parent.mkdir(parents=True, exist_ok=True)
                (copy / rel).write_bytes(get(f"{base}{name}/{rel}"))
        fails += verify_copy(soak, copy, s)
    latest = get(f"{base}latest").decode().strip() if f"{base}latest" in keys else None
    if latest != layout.step_dir_name(soak.last_step):
        fails.append(f"S3 latest {latest!r}, want step {soak.last_step}")
    allowed = {k for k in SENTINELS if k.startswith(base)} | {f"{base}latest"}
    for s in kept:
        name = layout.step_dir_name(s)
        allowed |= {f"{base}{name}/{f}" for f in [*tree(ref[s]), layout.MANIFEST_NAME]}
        allowed.add(f"{base}claims/{name}")
    outside = {*SENTINELS, *S3_ONLY}
    extra = sorted(k for k in keys if k not in allowed and k not in outside)
    if extra:
        fails.append(f"S3: unexpected keys: {extra[:20]} ({len(extra)})")
    pending = client.list_multipart_uploads(Bucket=soak.bucket).get("Uploads", [])
    if pending:
        fails.append(f"S3: pending multipart uploads: {[u['Key'] for u in pending][:10]}")
    return fails
