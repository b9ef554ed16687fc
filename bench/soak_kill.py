"""Crash soak: SIGKILL `stagerd watch` at random times while steps keep arriving, then check what it left.

    python bench/soak_kill.py [--seed 1] [--kills 40] [--keep-last 2] [--remote-keep-last 3] [--every 1.5]
                              [--workers 1] [--hub xet|lfs|off] [--phases any,point,...]
                              [--first-body-kills 4] [--restores 30] [--raw-restores 20]
                              [--work DIR] [--tamper]

Beyond the named crash points of `tests/daemon/crash/` (one kill at one exact place), this kills a long-
running daemon at seeded random wall-clock moments: a kill picks a phase (export, publish, retention, remote
prune or any time), waits for the daemon's log to show that phase starting, sleeps a random slice and
SIGKILLs it. A feeder commits new real DCP steps (copies of two gloo saves, each with extras naming its
step) throughout, and some while the daemon is dead. The sinks are a file:// directory and moto S3
(127.0.0.1), both with a literal prefix `run1` and sentinels beside and under it that nothing may touch:
`run10/`, `run1-old/`, a non-step directory and a foreign step directory under `run1/`.

A kill may instead come at a named crash point (`stagerd/ops/crashpoints.py`, the `point` phase: the daemon
runs with `STAGERD_CRASH_AT=NAME:K` and kills itself there; SIGKILLed anyway if it never gets there) or,
with the Hub sink, inside an upload body (the `body` phase: the Hub test server SIGKILLs the daemon once an
LFS PUT or part, or a Xet xorb, has a random number of bytes in). `--hub xet|lfs` adds the Hub sink (the
repo's Hub test server, huggingface_hub's Xet or LFS path: `soak_kill_hub.py`).

After the last kill a clean daemon settles the run; then `soak_kill_checks.py` checks the invariants (listed
there), and `soak_kill_hub.py` the Hub repo. Then `--restores N` kills `stagerd restore --export` N times
(`soak_kill_restore.py`, file://, S3 and the Hub) and the sinks are checked again, and `--raw-restores N`
kills raw restores from file:// and S3 into fresh ROOTs. Exit 0 when every one
holds; else the failures are printed and the work directory is kept.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from soak_kill_checks import (  # noqa: E402  (bench/ is sys.path[0])
    check_all,
    check_file_sink,
    check_s3_sink,
    reference_exports,
)
from soak_kill_hub import HubSide, check_hub  # noqa: E402
from soak_kill_restore import raw_restore_soak, restore_soak  # noqa: E402
from soak_kill_setup import Soak  # noqa: E402


def soak_steps(soak: Soak, rng: random.Random) -> list[int]:
    """The steps whose Hub tree is checked file by file: the newest, and up to 12 older ones (a sample: each
    costs a clean consolidate of its own)."""
    newest = list(range(max(1, soak.last_step - soak.remote_keep_last + 1), soak.last_step + 1))
    older = range(1, newest[0])
    return sorted(rng.sample(older, min(12, len(older)))) + newest


PHASES = {  # phase -> (log record that starts it, longest random sleep after it)
    "export": (lambda r: r.get("state") == "exporting", 0.6),
    "publish": (lambda r: r.get("state") == "publishing", 1.2),
    "retention": (lambda r: r.get("state") == "published" and r.get("sink") is None, 0.08),
    "prune": (lambda r: r.get("logger") == "stagerd.sinks.prune", 0.05),  # remote retention, mid-prefix
    "any": (lambda r: True, 3.0),
    "point": (lambda r: False, 0.0),  # a crash point: the daemon kills itself there
    "body": (lambda r: False, 0.0),  # the Hub server kills it inside an upload body
}
# The crash points a `watch` of these sinks reaches (`stagerd/ops/crashpoints.py`); K from 1 to 3.
WATCH_POINTS = [
    "export.move",
    "export.extra",
    "export.renamed",
    "file.upload",
    "file.create",
    "s3.part",
    "s3.probe",
    "fsspec.manifest",
    "publish.done",
    "retention.trashed",
    "retention.rmtree",
    "prune.tombstone",
    "prune.manifest",
    "prune.clock",
    "prune.files",
]


class Daemon:
    """One `stagerd watch` incarnation whose log goes to its own file."""

    def __init__(self, soak: Soak, n: int, **env: str) -> None:
        self.log = soak.work / "logs" / f"watch-{n:03d}.log"
        self.log.parent.mkdir(exist_ok=True)
        self._pos = 0
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                soak.watch_cmd(), env={**soak.env, **env}, cwd=REPO, stdout=out, stderr=out
            )

    def new_records(self) -> list[dict]:
        with open(self.log, "rb") as f:
            f.seek(self._pos)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self._pos += end
        out = []
        for line in data[:end].splitlines():
            if line.startswith(b"{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
        return out

    def wait_for(self, pred, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            if any(pred(r) for r in self.new_records()):
                return True
            time.sleep(0.01)
        return False


class Feeder(threading.Thread):
    """Commits a new step every `every` seconds (jittered) while running."""

    def __init__(self, soak: Soak, rng: random.Random, every: float) -> None:
        super().__init__(daemon=True)
        self.soak, self.rng, self.every = soak, rng, every
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(self.rng.uniform(0.3, 2 * self.every)):
            self.soak.commit_next()

    def stop(self) -> None:
        self.halt.set()
        self.join()


def settle(soak: Soak, n: int, timeout: float) -> tuple[int, str]:
    """A daemon left alone until every step is done and remote retention ran; then SIGTERM. (rc, log)."""
    d = Daemon(soak, n)
    deadline = time.monotonic() + timeout
    done_since = None
    while time.monotonic() < deadline and d.proc.poll() is None:
        if soak.all_done():
            done_since = done_since or time.monotonic()
            if time.monotonic() - done_since > 4:  # a few rescans: remote retention, sweeps
                break
        else:
            done_since = None
        time.sleep(0.5)
    if d.proc.poll() is None:
        d.proc.send_signal(signal.SIGTERM)
        try:
            d.proc.wait(60)
        except subprocess.TimeoutExpired:
            d.proc.kill()
            d.proc.wait()
    return d.proc.returncode, d.log.read_text()[-4000:]


def tamper(soak: Soak) -> list[tuple[str, str]]:
    """Break one thing of each kind the checks look for: (what, a word its failure message holds)."""
    from soak_kill_setup import PREFIX, SENTINELS

    sink = soak.fsink / PREFIX
    newest = f"step-{soak.last_step:08d}"
    (soak.fsink / "run10" / "latest").write_bytes(b"step-00000002\n")
    (sink / newest / ".model.safetensors.tmp-1-2").write_bytes(b"partial")
    (soak.root / ".stagerd" / "trash").mkdir(exist_ok=True)
    (soak.root / ".stagerd" / "trash" / "step-00000001").mkdir()
    (soak.root / ".step-00000001.lock").write_bytes(b"retention (pid 1)")
    (sink / "step-00000001").mkdir()
    client = soak.s3.client()
    client.delete_object(Bucket=soak.bucket, Key="run1-old/latest")
    client.put_object(Bucket=soak.bucket, Key="run1x", Body=b"a key that shares the prefix's letters")
    client.put_object(Bucket=soak.bucket, Key=f"{PREFIX}/latest", Body=b"step-00000001\n")
    assert "run1-old/latest" in SENTINELS
    hub = []
    if soak.hub is not None:
        from soak_kill_hub import REPO_ID

        api = soak.hub.api()
        api.create_branch(REPO_ID, branch="stagerd/leftover", revision="main")
        api.create_tag(REPO_ID, tag="step-999", revision="main")
        hub = [("Hub orphan branch", "branch stagerd/leftover"), ("Hub extra tag", "extra ['step-999']")]
    return [
        *hub,
        ("file sentinel rewritten", "run10/latest"),
        ("file temp left", "unexpected files"),
        ("ROOT trash left", "trash/step-00000001"),
        ("ROOT step lock left", ".step-00000001.lock"),
        ("file sink empty step dir", "step-00000001/ (empty)"),
        ("S3 sentinel deleted", "run1-old/latest"),
        ("S3 sentinel written again", "written again (same bytes)"),
        ("S3 latest behind", "S3 latest"),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kills", type=int, default=40)
    ap.add_argument("--keep-last", type=int, default=2)
    ap.add_argument("--remote-keep-last", type=int, default=3)
    ap.add_argument("--every", type=float, default=1.5, help="mean seconds between new steps")
    ap.add_argument("--workers", type=int, default=1, help="--export-workers and --publish-workers")
    ap.add_argument("--settle-timeout", type=float, default=300)
    ap.add_argument(
        "--hub", choices=("xet", "lfs", "off"), default="xet", help="a Hub sink, and its upload path"
    )
    ap.add_argument(
        "--phases", default=",".join(PHASES), help=f"kill phases to draw from (of {','.join(PHASES)})"
    )
    ap.add_argument("--first-body-kills", type=int, default=4, help="with --hub: the first kills' phase")
    ap.add_argument("--restores", type=int, default=30, help="kills of `stagerd restore` after settling")
    ap.add_argument("--raw-restores", type=int, default=20, help="kills of raw `stagerd restore`s")
    ap.add_argument("--work", type=Path, help="work directory (kept); default a temporary one")
    ap.add_argument(
        "--tamper",
        action="store_true",
        help="check the checks: after settling, break one thing of each kind; exit 0 only if all are caught",
    )
    a = ap.parse_args()
    if not set(a.phases.split(",")) <= set(PHASES):
        ap.error(f"--phases: unknown {sorted(set(a.phases.split(',')) - set(PHASES))}")

    rng = random.Random(a.seed)
    work = a.work or Path(tempfile.mkdtemp(prefix=f"stagerd-soak-kill-{a.seed}-"))
    work.mkdir(parents=True, exist_ok=True)
    from tests.s3server import S3TestServer

    server = S3TestServer()
    ok = False
    soak: Soak | None = None
    try:
        soak = Soak.create(work, server, f"soak-{uuid.uuid4().hex[:8]}", a.keep_last, a.remote_keep_last)
        soak.workers = a.workers
        if a.hub != "off":
            soak.add_hub(HubSide(work, a.hub))
        for _ in range(3):
            soak.commit_next()
        feeder = Feeder(soak, random.Random(a.seed + 1000), a.every)
        feeder.start()
        kills: dict[str, int] = {}
        phases = [p for p in a.phases.split(",") if p != "body" or soak.hub is not None]
        points = WATCH_POINTS + (["hub.commit"] if soak.hub is not None else [])
        t0 = time.monotonic()
        for n in range(a.kills):
            # only a model's first steps upload much (later ones dedup): the first kills go inside those
            phase = "body" if soak.hub is not None and n < a.first_body_kills else rng.choice(phases)
            pred, longest = PHASES[phase]
            env = {}
            if phase == "point":
                phase = f"{rng.choice(points)}:{rng.randint(1, 3)}"
                env["STAGERD_CRASH_AT"] = phase
            d = Daemon(soak, n, **env)
            if phase == "body":
                soak.hub.arm_body_kill(d.proc.pid, rng.randint(64 << 10, 8 << 20))
            if phase in PHASES and phase != "body":
                seen = d.wait_for(pred, timeout=20)
                time.sleep(rng.uniform(0, longest))
            else:  # it kills itself, or the Hub server kills it
                try:
                    d.proc.wait(10)
                except subprocess.TimeoutExpired:
                    pass
                seen = d.proc.poll() is not None
            if soak.hub is not None:
                soak.hub.disarm()
            name = phase.split(":")[0] if seen else f"{phase.split(':')[0]} (not reached)"
            if d.proc.poll() is None:
                d.proc.kill()
                kills[name] = kills.get(name, 0) + 1
            elif d.proc.returncode == -signal.SIGKILL:
                kills[name] = kills.get(name, 0) + 1
            d.proc.wait()
            if d.proc.returncode not in (-signal.SIGKILL,):
                print(f"kill {n}: daemon exited {d.proc.returncode} by itself\n{d.log.read_text()[-3000:]}")
            soak.note_manifests()
            for _ in range(rng.choice((0, 0, 1, 2))):  # steps committed while the daemon is dead
                soak.commit_next()
            time.sleep(rng.uniform(0, 0.5))
            print(
                f"kill {n + 1}/{a.kills}: {phase}{'' if seen else ' (not seen)'} steps={soak.last_step} "
                f"t={time.monotonic() - t0:.0f}s",
                flush=True,
            )
        feeder.stop()
        rc, tail = settle(soak, a.kills, a.settle_timeout)
        failures = [] if rc == 0 else [f"settling daemon exited {rc}:\n{tail}"]
        if a.tamper:
            broken = tamper(soak)
            failures += check_all(soak)
            if soak.hub is not None:
                failures += check_hub(
                    soak.hub, soak.last_step, reference_exports(soak, soak_steps(soak, random.Random(a.seed)))
                )
            missed = [what for what, sign in broken if not any(sign in f for f in failures)]
            print(f"tamper: {len(broken) - len(missed)}/{len(broken)} caught; missed: {missed}")
            return 1 if missed else 0
        failures += check_all(soak)
        if soak.hub is not None:
            failures += check_hub(
                soak.hub, soak.last_step, reference_exports(soak, soak_steps(soak, random.Random(a.seed)))
            )
        t1 = time.monotonic()
        restore_kills: dict[str, int] = {}
        if a.restores and not failures:
            restore_kills, fails = restore_soak(
                soak, reference_exports(soak), random.Random(a.seed + 7), a.restores
            )
            ref = reference_exports(soak)
            failures += fails + check_file_sink(soak, ref) + check_s3_sink(soak, ref)
        raw_kills: dict[str, int] = {}
        if a.raw_restores and not failures:
            raw_kills, fails = raw_restore_soak(soak, random.Random(a.seed + 8), a.raw_restores)
            failures += fails
        print(
            json.dumps(
                dict(
                    seed=a.seed,
                    hub=a.hub,
                    kills=kills,
                    body_kills=soak.hub.body_kills if soak.hub is not None else 0,
                    restore_kills=restore_kills,
                    raw_restore_kills=raw_kills,
                    steps=soak.last_step,
                    seconds=round(t1 - t0),
                    restore_seconds=round(time.monotonic() - t1),
                ),
            )
        )
        for f in failures:
            print("FAIL:", f)
        ok = not failures
        print("OK: every invariant holds" if ok else f"{len(failures)} failure(s); work dir kept: {work}")
        return 0 if ok else 1
    finally:
        server.stop()
        if soak is not None and soak.hub is not None:
            soak.hub.stop()
        if ok and a.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
