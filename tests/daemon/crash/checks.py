"""What every crash-injection case shares: the case, the daemon's environment, and the checks that run once
the clean restart has: published exactly once, byte for byte, nothing half-done, no partial step seen."""

from __future__ import annotations

import hashlib
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from stagerd.contract import layout
from stagerd.daemon.journal import Journal
from tests.daemon.crash.reader import (
    HUB_REPO,
    Files,
    Reader,
    Sinks,
    dir_files,
    dir_files_except_manifest,
    hub_files,
)
from tests.daemon_helpers import clean_env


@dataclass(frozen=True)
class Case:
    """Kill at the `n`-th arrival at `point`, with these sinks and steps; then, for a chain of crashes,
    restart and kill again at each of `then` (`point:N`) before the clean restart. A kill that comes from
    outside the daemon (the Hub server's LFS hook) names no crash point: its `point` is only a label."""

    point: str
    n: int
    sinks: tuple[str, ...] = ("file",)
    kind: str = "small"
    steps: tuple[int, ...] = (1, 2)
    keep_last: int | None = None
    then: tuple[str, ...] = ()

    @property
    def kills(self) -> list[str]:
        return [f"{self.point}:{self.n}", *self.then]

    @property
    def id(self) -> str:
        return f"{'>'.join(self.kills)}-{'+'.join(self.sinks)}"


def run_env(sinks: Sinks, **extra: str) -> dict[str, str]:
    env = clean_env(dict(**extra))
    if sinks.hub is not None:
        env.update(
            HF_ENDPOINT=sinks.hub.endpoint,
            HF_TOKEN=sinks.hub.token,
            HF_HUB_DISABLE_PROGRESS_BARS="1",
        )
    return env


def published_events(root: Path) -> tuple[dict[int, int], dict[tuple[int, str], int]]:
    """(step -> step-level `published` events, (step, sink) -> lane `published` events), and states."""
    j = Journal.open_readonly(root)
    try:
        steps: dict[int, int] = {}
        lanes: dict[tuple[int, str], int] = {}
        for e in j.events():
            if e.to_state != "published":
                continue
            if e.sink is None:
                steps[e.step] = steps.get(e.step, 0) + 1
            else:
                lanes[(e.step, e.sink)] = lanes.get((e.step, e.sink), 0) + 1
        return steps, lanes
    finally:
        j.close()


def file_manifests(d: Path | None) -> dict[int, tuple[int, bytes]]:
    """step -> (inode, bytes) of each file:// manifest: a restart must leave committed ones untouched."""
    if d is None:
        return {}
    out = {}
    for m in d.glob(f"step-*/{layout.MANIFEST_NAME}"):
        out[json.loads(m.read_text())["step"]] = (m.stat().st_ino, m.read_bytes())
    return out


def assert_recovered(
    case: Case,
    root: Path,
    sinks: Sinks,
    expected: dict[int, Files],
    restarted: subprocess.CompletedProcess,
    violations: list[str],
    reader: Reader,
    killed: list[int],
    after_crash: dict[int, tuple[int, bytes]],
) -> None:
    """What every kill case checks once the clean restart has run: published once, byte for byte, nothing
    half-done, and the reader never saw a partial step."""
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert f"{len(case.steps)} step(s) published, 0 not" in restarted.stdout
    assert not violations, violations
    assert reader.polls > 10, reader.polls

    # -- published exactly once, per the journal --------------------------------------------------------
    retired = (
        set(case.steps[: max(0, len(case.steps) - case.keep_last)]) if case.keep_last is not None else set()
    )
    j = Journal.open_readonly(root)
    try:
        states = {r.step: r.state for r in j.steps()}
        lanes = {(ln.step, ln.sink): ln.state for ln in j.lanes()}
    finally:
        j.close()
    assert states == {s: "retired" if s in retired else "published" for s in case.steps}
    urls = sinks.urls()
    assert lanes == {(s, u): "published" for s in case.steps for u in urls}
    step_events, lane_events = published_events(root)
    assert step_events == dict.fromkeys(case.steps, 1)
    assert lane_events == {(s, u): 1 for s in case.steps for u in urls}

    # -- ROOT: exports as a clean run made them; nothing half-deleted, nothing left over ---------------------
    for step in case.steps:
        step_dir = root / layout.step_dir_name(step)
        if step in retired:
            assert not step_dir.exists()
            continue
        assert dir_files(step_dir / layout.EXPORT_DIR) == expected[step]
        assert not (step_dir / layout.EXPORT_TMP_DIR).exists()
    trash = root / layout.STATE_DIR / "trash"
    assert not trash.exists() or not any(trash.iterdir())
    # retention holds a step's lock while it trashes the step: a kill then leaves the lock file, which
    # nobody takes again once the step is retired
    assert not sorted(p.name for p in root.glob(".step-*.lock")), "a killed holder's step lock file is left"

    # -- every sink: each step once, byte-identical to the clean export --------------------------------------
    last = layout.step_dir_name(max(case.steps))
    if sinks.file_dir is not None:
        d = sinks.file_dir
        for step in case.steps:
            assert dir_files_except_manifest(d / layout.step_dir_name(step)) == expected[step]
        assert (d / "latest").read_text().strip() == last
        # Temp names (`.NAME.tmp-HOST-PID-TID`, `.NAME.tmp-PID[-TID]`) are invisible to a reader. The restart
        # must leave none of its own; the killed daemon's are removed only once the sink sweeps them (a
        # file.upload or file.create kill leaves one every time: its case asserts none is left; other kills
        # leave one only by timing).
        leftovers = sorted(str(p.relative_to(d)) for p in d.rglob(".*"))
        ours = [(f"-{pid}-", f".tmp-{pid}") for pid in killed]
        assert all(any(a in name or b in name for a, b in ours) for name in leftovers), leftovers
        if case.point in ("file.upload", "file.create"):
            assert not leftovers, f"temp files the killed daemon left in the file:// sink: {leftovers}"
        now = file_manifests(d)
        assert set(now) == set(case.steps)
        assert {s: now[s] for s in after_crash} == after_crash, "a committed manifest was rewritten"
    if sinks.s3 is not None:
        s3env, base = sinks.s3, f"{sinks.s3_prefix}/"
        for step in case.steps:
            key = f"{base}{layout.step_dir_name(step)}/{layout.MANIFEST_NAME}"
            puts = [r for r in s3env.proxy.log if r.op == "PutObject" and r.key.endswith(key)]
            assert [r.status for r in puts if r.status == 200] == [200], (step, puts)
            got = {
                name: (len(data := s3env.get(f"{base}{layout.step_dir_name(step)}/{name}")), sha(data))
                for name in expected[step]
            }
            assert got == expected[step]
        # a kill inside a backend's probe of the store (`s3/conditions.py`) leaves its scratch keys: the
        # restart's probe deletes them
        objects = set(s3env.keys(base))
        assert set(objects) == {f"{base}latest"} | {
            f"{base}{layout.step_dir_name(s)}/{f}"
            for s in case.steps
            for f in [*expected[s], layout.MANIFEST_NAME]
        } | {f"{base}claims/{layout.step_dir_name(s)}" for s in case.steps}  # each step's one publisher
        assert s3env.get(f"{base}latest").decode().strip() == last
        # A killed multipart upload stays pending until the restart's publish of that step sweeps it.
        pending = s3env.client.list_multipart_uploads(Bucket=s3env.bucket).get("Uploads", [])
        assert not pending, [u["Key"] for u in pending]
    if sinks.hub is not None:
        hub = sinks.hub
        with hub.store.lock:
            repo = hub.store.repos[HUB_REPO]
            commits = [c for c in repo.commits.values() if c.title.startswith("stagerd: step")]
            tags = dict(repo.tags)
        assert sorted(c.title for c in commits) == [f"stagerd: step {s}" for s in case.steps]
        assert hub.stats.commits[HUB_REPO] == len(case.steps)
        assert set(tags) == {f"step-{s}" for s in case.steps}
        for c in commits:
            step = int(c.title.rsplit(" ", 1)[1])
            assert tags[f"step-{step}"] == c.oid
            assert hub_files(hub, c) == expected[step]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
