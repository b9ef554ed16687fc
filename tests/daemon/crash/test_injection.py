"""Crash injection: SIGKILL `stagerd watch --once` at every named crash point, restart, check nothing broke.

Each case stages real DCP saves, runs the daemon with `STAGERD_CRASH_AT=point:N` (see
`stagerd/ops/crashpoints.py`) against real sinks (file://, moto S3 behind the fault proxy, the Hub-protocol
test server), asserts it died by SIGKILL at that point, restarts it without the variable, and asserts:

- every step ends `published` (or `retired`, where retention removed it) and was published exactly once:
  one `published` journal event per step and per lane, one manifest PUT per step on S3 (the proxy's
  request log), one `stagerd: step N` commit per step on the Hub, file:// manifests untouched by the
  restart;
- the export and every published copy are byte-identical to a clean run's export;
- no reader ever saw a partial step: a `Reader` thread polls ROOT and every sink while both daemons run
  (an `export/` is whole or absent; a manifest, a tag, `latest` or the branch head only ever name a
  complete step; a step directory leaves ROOT only once every sink holds it).

One place has no crash point because no stagerd line runs there: inside huggingface_hub's LFS upload. For
it the Hub test server itself SIGKILLs the daemon once an upload body is partly received
(`HubServer.on_lfs_body`), and the same checks follow.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from stagerd.contract import layout
from stagerd.ops.crashpoints import ENV, POINTS
from tests import s3server
from tests.cli_helpers import STAGERD
from tests.daemon.crash.checks import Case, assert_recovered, file_manifests, run_env
from tests.daemon.crash.reader import (
    HUB_REPO,
    Files,
    Reader,
    Sinks,
    dir_files,
    sha256_file,
)
from tests.daemon_helpers import REPO, clean_env, fast_flags
from tests.dcp_fixtures import commit_step

s3_server, s3 = s3server.s3_server, s3server.s3

pytestmark = pytest.mark.slow


# -- staging and the clean reference -------------------------------------------------------------------


def stage(root: Path, step: int, model: Path) -> Path:
    """A committed step: real DCP shards, two extras (one naming the step), the marker written last."""
    step_dir = root / layout.step_dir_name(step)
    shutil.copytree(model, step_dir / "model")
    (step_dir / "extras").mkdir()
    (step_dir / "extras" / "config.json").write_text(json.dumps({"model_type": "tiny", "step": step}))
    (step_dir / "extras" / "tokenizer.json").write_text('{"version": "1.0"}\n')
    commit_step(step_dir, world=2)
    return step_dir


def watch_cmd(root: Path, sinks: list[str], *extra: str) -> list[str]:
    cmd = [*STAGERD, "watch", str(root), "--once", *fast_flags(), *extra]
    for url in sinks:
        cmd += ["--sink", url]
    return cmd


@pytest.fixture(scope="module")
def reference(tmp_path_factory, dcp_mixed2, dcp_big) -> dict[str, dict[int, Files]]:
    """A clean run (no crash) per checkpoint kind: step -> its export's files."""
    out = {}
    for kind, model in (("small", dcp_mixed2[0]), ("big", dcp_big)):
        base = tmp_path_factory.mktemp(f"clean-{kind}")
        root = base / "root"
        steps = (1, 2, 3)
        for step in steps:
            stage(root, step, model)
        r = subprocess.run(
            watch_cmd(root, [(base / "sink").as_uri()]),
            env=clean_env(),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        out[kind] = {s: dir_files(root / layout.step_dir_name(s) / layout.EXPORT_DIR) for s in steps}
    return out


# -- the cases -----------------------------------------------------------------------------------------------


# dcp_mixed2 exports with 12 byte moves per step (runs of its small tensors go as one move each) and 2
# extras; exports run one at a time, in step order.
CASES = [
    Case("export.move", 1),
    Case("export.move", 6),
    Case("export.move", 13),  # the first move of step 2, step 1 already exported
    Case("export.extra", 1),
    Case("export.extra", 2),
    Case("export.extra", 3),
    Case("export.renamed", 1),
    Case("export.renamed", 2, sinks=("file", "s3")),
    Case("file.upload", 1),
    Case("file.upload", 5, sinks=("file", "hub")),  # step 2's first file (4 files a step)
    Case("file.create", 1),  # step 1's claim
    Case("file.create", 2, sinks=("file", "s3")),  # step 1's manifest
    Case("s3.part", 1, sinks=("s3", "file"), kind="big"),
    Case("s3.part", 4, sinks=("s3", "file"), kind="big"),  # step 2's first part, step 1 on S3 already
    Case("s3.probe", 1, sinks=("s3", "file")),
    Case("s3.probe", 1, sinks=("s3",), then=("s3.probe:1",)),  # two killed probes' keys, both swept
    Case("fsspec.manifest", 1, sinks=("file", "s3")),
    Case("fsspec.manifest", 2, sinks=("file", "s3")),
    Case("fsspec.manifest", 4, sinks=("file", "s3")),  # the last manifest of the run
    Case("hub.commit", 1, sinks=("hub", "file")),
    Case("hub.commit", 2, sinks=("hub", "file")),
    Case("publish.done", 1, sinks=("file", "s3", "hub")),
    Case("publish.done", 3, sinks=("file", "s3", "hub")),
    Case("publish.done", 6, sinks=("file", "s3", "hub")),  # the last publish of the run
    Case("retention.trashed", 1, steps=(1, 2, 3), keep_last=1),
    Case("retention.trashed", 2, sinks=("file", "s3"), steps=(1, 2, 3), keep_last=1),
    Case("retention.rmtree", 1, steps=(1, 2, 3), keep_last=1),
    Case("retention.rmtree", 2, steps=(1, 2, 3), keep_last=0),
    # Chains: killed again while recovering from the last kill. Each later point is one the resumed run
    # must reach whatever the timing of the kill before (step 2 is not exported before its rename, its
    # publishes are all still to come; a trash leftover is removed first thing at start).
    Case(
        "export.move",
        5,
        sinks=("file", "s3", "hub"),
        then=("export.renamed:2", "publish.done:2", "publish.done:1"),
    ),
    Case(
        "retention.trashed",
        1,
        sinks=("file", "s3"),
        steps=(1, 2, 3),
        keep_last=1,
        then=("retention.rmtree:1", "retention.trashed:1"),
    ),
]


def test_every_crash_point_is_injected_at_least_twice():
    kills = [k.split(":")[0] for c in CASES for k in c.kills]
    counts = {p: kills.count(p) for p in POINTS if not p.startswith(("restore.", "prune.", "fleet."))}
    assert all(n >= 2 for n in counts.values()), counts
    assert len(kills) >= 20


@pytest.fixture
def sinks_for(request, tmp_path) -> Iterator[Callable[..., Sinks]]:
    """Builds the sinks a case names; starts the Hub server (and takes the S3 fixture) only when named."""
    started = []

    def make(case: Case, hub_config: Any = None) -> Sinks:
        s = Sinks()
        if "file" in case.sinks:
            s.file_dir = tmp_path / "sink"
        if "s3" in case.sinks:
            s.s3 = request.getfixturevalue("s3")
        if "hub" in case.sinks:
            from tests.hubserver import HubServer

            s.hub = HubServer(config=hub_config).start()
            started.append(s.hub)
        return s

    yield make
    for hub in started:
        hub.stop()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_sigkill_at_crash_point_then_restart(case: Case, tmp_path, reference, dcp_mixed2, dcp_big, sinks_for):
    model = dcp_mixed2[0] if case.kind == "small" else dcp_big
    expected = {s: reference[case.kind][s] for s in case.steps}
    root = tmp_path / "root"
    for step in case.steps:
        stage(root, step, model)
    sinks = sinks_for(case)
    extra = ("--keep-last", str(case.keep_last)) if case.keep_last is not None else ()
    cmd = watch_cmd(root, sinks.urls(), *extra)
    reader = Reader(root, expected, sinks)
    reader.start()
    killed: list[int] = []  # pids of the killed daemons
    after_crash: dict[int, tuple[int, bytes]] = {}  # file:// manifests as the first kill that saw them
    try:
        for kill in case.kills:
            proc = subprocess.Popen(
                cmd,
                env=run_env(sinks, **{ENV: kill}),
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            _, crash_err = proc.communicate(timeout=120)
            assert proc.returncode == -signal.SIGKILL, (kill, proc.returncode, crash_err[-3000:])
            assert f"crash point {kill} reached" in crash_err
            killed.append(proc.pid)
            reader.check()  # the state the kill left, as a reader finds it
            after_crash = {**file_manifests(sinks.file_dir), **after_crash}

        restarted = subprocess.run(
            cmd, env=run_env(sinks), cwd=REPO, capture_output=True, text=True, timeout=120
        )
    finally:
        violations = reader.stop()
    assert_recovered(case, root, sinks, expected, restarted, violations, reader, killed, after_crash)


# -- a kill inside the LFS upload, from the Hub server ------------------------------------------------------

MiB = 1 << 20


@dataclass(frozen=True)
class LfsKill:
    """SIGKILL the daemon once the `nth` LFS upload request to receive `after` bytes of body has them.

    The big checkpoint's export has one safetensors file (about 35 MB), the only LFS object of a step;
    step 2's is byte-identical to step 1's, so the Hub already holds it then and only step 1 uploads.
    """

    id: str
    after: int
    nth: int
    multipart_chunk: int | None  # None: one basic PUT; else the server asks for parts of this size


LFS_KILLS = [
    LfsKill("basic-put-at-8MiB", after=8 * MiB, nth=1, multipart_chunk=None),
    LfsKill("multipart-part-2-at-4MiB", after=4 * MiB, nth=2, multipart_chunk=16 * MiB),  # part 1 landed
]


def lfs_objects_are_whole(hub: Any) -> list[str]:
    """LFS objects of the repo whose stored bytes do not hash to their oid or have the wrong size."""
    with hub.store.lock:
        held = dict(hub.store.repos[HUB_REPO].lfs)
    bad = []
    for oid, size in held.items():
        path = hub.store.lfs_path(oid)
        if not path.is_file() or path.stat().st_size != size or sha256_file(path) != oid:
            bad.append(oid)
    return bad


@pytest.mark.parametrize("kill", LFS_KILLS, ids=[k.id for k in LFS_KILLS])
def test_sigkill_inside_the_hub_lfs_upload_then_restart(
    kill: LfsKill, tmp_path, reference, dcp_big, sinks_for
):
    from tests.hubserver import HubConfig

    case = Case("hub.lfs-upload", kill.nth, sinks=("hub", "file"), kind="big")
    config = HubConfig()
    if kill.multipart_chunk is not None:
        config = HubConfig(
            multipart_threshold=kill.multipart_chunk, multipart_chunk_size=kill.multipart_chunk
        )
    expected = {s: reference["big"][s] for s in case.steps}
    root = tmp_path / "root"
    for step in case.steps:
        stage(root, step, dcp_big)
    sinks = sinks_for(case, config)
    hub = sinks.hub
    cmd = watch_cmd(root, sinks.urls())
    lfs_env = run_env(sinks, HF_HUB_DISABLE_XET="1")  # the kill is inside the LFS upload: that path
    started, pid, seen = threading.Event(), [], {}

    def sigkill_the_daemon() -> None:  # runs in the server's request thread, the body half received
        started.wait(60)
        seen.update(commits=hub.stats.commits[HUB_REPO], uploads=sum(hub.stats.lfs_uploads.values()))
        os.kill(pid[0], signal.SIGKILL)

    hook = hub.on_lfs_body(kill.after, sigkill_the_daemon, nth=kill.nth)
    reader = Reader(root, expected, sinks)
    reader.start()
    try:
        proc = subprocess.Popen(
            cmd, env=lfs_env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        pid.append(proc.pid)
        started.set()
        _, crash_err = proc.communicate(timeout=120)
        assert proc.returncode == -signal.SIGKILL, (proc.returncode, crash_err[-3000:])
        assert hook.fired
        reader.check()
        restarted = subprocess.run(cmd, env=lfs_env, cwd=REPO, capture_output=True, text=True, timeout=120)
    finally:
        violations = reader.stop()

    # The kill landed mid-upload: nothing committed, no object completed (part 1 of a multipart upload
    # is a part, not an object), and the request it cut off never answered 200.
    assert seen == {"commits": 0, "uploads": 0}, seen
    lfs_requests = hub.stats.count("PUT", r"^/_lfs/(put|part)/")
    assert lfs_requests > hub.stats.count("PUT", r"^/_lfs/(put|part)/", status=200)
    assert_recovered(case, root, sinks, expected, restarted, violations, reader, [pid[0]], {})
    # The restart sent the object whole, once; the cut-off body never became an object.
    assert list(hub.stats.lfs_uploads.values()) == [1], hub.stats.lfs_uploads
    assert not lfs_objects_are_whole(hub)
