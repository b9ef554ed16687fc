"""The crash soak's restore phase (`bench/soak_kill.py --restores N`): `stagerd restore URL OUT --export` of a
kept step from the file:// sink, S3 and the Hub, SIGKILLed at a random moment or at the crash point
`restore.piece:K` (1 to 3 kills in a chain into one OUT), then run again to the end. Raw restores
(`--raw-restores N`) are killed the same way and at `restore.landed` and `restore.journaled`: see
`raw_restore_soak`.

Checks:
- after each kill OUT is absent or, if the restore got as far as its rename, exactly the step's reference
  export (the Hub adds its `README.md`): nothing partial ever looks restored;
- the clean run after the kills exits 0 (no lease or temp directory of a killed restore stands in its way)
  and OUT is exactly the reference export;
- in the end nothing else is beside the OUTs (no `.OUT.tmp-*` or `.OUT.restore-*` of a killed restore),
  and no lease is left under `PREFIX/restoring/` on file:// or S3 (each restore removes the dead ones of
  this host: a last clean restore from each sink runs after the kills).
"""

from __future__ import annotations

import random
import signal
import subprocess
from pathlib import Path
from typing import Any

from soak_kill_setup import PREFIX, Soak, tree

from tests.cli_helpers import STAGERD
from tests.daemon_helpers import REPO

HUB_EXTRA = {"README.md"}


def _restore(soak: Soak, url: str, out: Path, step: int, crash: str | None) -> subprocess.Popen:
    env = dict(soak.env)
    if crash:
        env["STAGERD_CRASH_AT"] = crash
    cmd = [*STAGERD, "restore", url, str(out), "--export", "--step", str(step), "--workers", "4"]
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(p: subprocess.Popen, rng: random.Random | None) -> tuple[str, str]:
    """Its output once it ends; with `rng`, killed at a random moment (0.1-1.5 s in) if still running."""
    if rng is not None:
        try:
            p.wait(rng.uniform(0.1, 1.5))
        except subprocess.TimeoutExpired:
            p.kill()
    return p.communicate(timeout=300)


def _same(out: Path, ref: Path, hub: bool) -> bool:
    got = tree(out)
    if hub:
        got = {k: v for k, v in got.items() if k not in HUB_EXTRA}
    return got == tree(ref)


def sources(soak: Soak) -> dict[str, str]:
    urls = {"file": (soak.fsink / PREFIX).as_uri(), "s3": f"s3://{soak.bucket}/{PREFIX}"}
    if soak.hub is not None:
        urls["hub"] = soak.hub.url
    return urls


def restore_soak(soak: Soak, refs: dict[int, Path], rng: random.Random, n: int) -> tuple[dict, list[str]]:
    """`n` kills of restores; (kills by sink and how, failures)."""
    fails: list[str] = []
    kills: dict[str, int] = {}
    outs = soak.work / "restores"
    outs.mkdir(exist_ok=True)
    urls = sources(soak)
    i = done = 0
    while done < n:
        i += 1
        kind = rng.choice(sorted(urls))
        step = rng.choice(sorted(refs))
        out = outs / f"out-{i:03d}"
        for _ in range(min(rng.choice((1, 1, 2, 3)), n - done)):
            how = rng.choice(("time", "piece"))
            crash = f"restore.piece:{rng.randint(1, 3)}" if how == "piece" else None
            p = _restore(soak, urls[kind], out, step, crash)
            _, err = _finish(p, rng if how == "time" else None)
            if p.returncode == 0:
                how = "finished first"
            elif p.returncode != -signal.SIGKILL:
                fails.append(
                    f"restore {kind} step {step} into {out.name} exited {p.returncode}: {err[-800:]}"
                )
            key = f"{kind} {how}"
            kills[key] = kills.get(key, 0) + (p.returncode == -signal.SIGKILL)
            done += p.returncode == -signal.SIGKILL
            if out.exists() and not _same(out, refs[step], kind == "hub"):
                fails.append(
                    f"restore {kind} step {step}: {out.name} exists but is not the whole step ({how})"
                )
            if out.exists():
                break
        if not out.exists():
            r = _restore(soak, urls[kind], out, step, None)
            _, err = r.communicate(timeout=300)
            if r.returncode != 0 or not _same(out, refs[step], kind == "hub"):
                fails.append(f"restore {kind} step {step} after a kill: exit {r.returncode}: {err[-800:]}")
        print(f"restore {i}: {kind} step {step} kills={done}/{n}", flush=True)
    for kind, url in sorted(urls.items()):  # a last clean restore from each sink sweeps the dead leases
        out = outs / f"last-{kind}"
        step = max(refs)
        r = _restore(soak, url, out, step, None)
        _, err = r.communicate(timeout=300)
        if r.returncode != 0 or not _same(out, refs[step], kind == "hub"):
            fails.append(f"last clean restore from {kind}: exit {r.returncode}: {err[-800:]}")
    left = sorted(p.name for p in outs.iterdir() if not p.name.startswith(("out-", "last-")))
    if left:
        fails.append(f"restore temp dirs left beside OUT: {left[:10]}")
    fails += leases_left(soak, soak.fsink / PREFIX, soak.bucket, PREFIX)
    return kills, fails


def leases_left(soak: Soak, sink: Path, bucket: str, prefix: str) -> list[str]:
    fails = []
    d = sink / "restoring"
    if d.exists():
        fails.append(f"file sink: restoring/ left: {sorted(p.name for p in d.iterdir())[:10]}")
    client: Any = soak.s3.client()
    page = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/restoring/")
    keys = [o["Key"] for o in page.get("Contents", [])]
    if keys:
        fails.append(f"S3: leases left: {keys[:10]}")
    return fails


RAW_PREFIX = "run2raw"
RAW_POINTS = ("restore.piece", "restore.landed", "restore.journaled")


def raw_restore_soak(soak: Soak, rng: random.Random, n: int) -> tuple[dict, list[str]]:
    """`n` kills of raw restores (`stagerd restore URL ROOT --step N`) from file:// and S3 into fresh ROOTs:
    a step a `watch --once --publish-raw` of two steps sent to `PREFIX=run2raw`. After each kill the step
    is uncommitted in ROOT or committed whole; the next run lands it (or finds it committed); in the end
    each ROOT holds the step whole, recorded once in its journal, nothing in `.stagerd/restore/`, and no
    lease is left on either sink."""
    from stagerd.contract import layout
    from stagerd.daemon.journal import Journal
    from tests.daemon.crash.test_injection import stage
    from tests.daemon_helpers import fast_flags

    src = soak.work / "raw-src"
    bucket = f"{soak.bucket}-raw"  # apart from the soak's sinks, whose checks list every key
    soak.s3.client().create_bucket(Bucket=bucket)
    urls = {"file": (soak.work / "fsink-raw" / RAW_PREFIX).as_uri(), "s3": f"s3://{bucket}/{RAW_PREFIX}"}
    steps = (1, 2)
    for s in steps:
        stage(src, s, soak.model_of(s))
    cmd = [*STAGERD, "watch", str(src), "--once", "--publish-raw", *fast_flags()]
    for url in urls.values():
        cmd += ["--sink", url]
    r = subprocess.run(cmd, env=soak.env, cwd=REPO, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        return {}, [f"raw source watch --once exited {r.returncode}: {r.stderr[-1500:]}"]
    want = {
        s: {k: v for k, v in tree(src / layout.step_dir_name(s)).items() if not k.startswith("export")}
        for s in steps
    }
    fails: list[str] = []
    kills: dict[str, int] = {}
    roots = soak.work / "raw-roots"
    i = done = 0
    while done < n:
        i += 1
        kind, step = rng.choice(sorted(urls)), rng.choice(steps)
        root = roots / f"root-{i:03d}"
        step_dir = root / layout.step_dir_name(step)
        args = [*STAGERD, "restore", urls[kind], str(root), "--step", str(step), "--workers", "4"]
        for _ in range(min(rng.choice((1, 2, 3)), n - done)):
            if layout.is_committed(step_dir):  # a kill after its marker: the next run finds it committed
                break
            how = rng.choice(("time", *RAW_POINTS))
            env = dict(soak.env)
            if how != "time":
                env["STAGERD_CRASH_AT"] = f"{how}:{rng.randint(1, 3) if how == 'restore.piece' else 1}"
            p = subprocess.Popen(
                args, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            _, err = _finish(p, rng if how == "time" else None)
            killed = p.returncode == -signal.SIGKILL
            if not killed and p.returncode != 0:
                fails.append(
                    f"raw restore {kind} step {step} into {root.name} exited {p.returncode}: {err[-800:]}"
                )
            kills[f"{kind} {how}"] = kills.get(f"{kind} {how}", 0) + killed
            done += killed
            if layout.is_committed(step_dir) and tree(step_dir) != want[step]:
                fails.append(
                    f"raw restore {kind} step {step}: {root.name} holds it committed but not whole ({how})"
                )
            if not killed:
                break
        if not layout.is_committed(step_dir):
            r = subprocess.run(args, env=soak.env, cwd=REPO, capture_output=True, text=True, timeout=300)
            if r.returncode != 0:
                fails.append(
                    f"raw restore {kind} step {step} after a kill: exit {r.returncode}: {r.stderr[-800:]}"
                )
        if not layout.is_committed(step_dir) or tree(step_dir) != want[step]:
            fails.append(f"raw restore {kind} step {step}: {root.name} does not hold the step whole")
        left = sorted(p.name for p in root.iterdir() if p.name not in (layout.STATE_DIR, step_dir.name))
        left += [f"{layout.STATE_DIR}/restore"] if (root / layout.STATE_DIR / "restore").exists() else []
        if left:
            fails.append(f"raw restore {root.name}: left {left}")
        j = Journal.open_readonly(root)
        try:
            rows = [r.step for r in j.steps()]
        finally:
            j.close()
        if rows != [step]:
            fails.append(f"raw restore {root.name}: journal steps {rows}, want [{step}]")
        print(f"raw restore {i}: {kind} step {step} kills={done}/{n}", flush=True)
    for kind, url in sorted(urls.items()):  # a last clean restore from each sink sweeps the dead leases
        r = subprocess.run(
            [*STAGERD, "restore", url, str(roots / f"last-{kind}"), "--step", "2"],
            env=soak.env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if r.returncode != 0:
            fails.append(f"last clean raw restore from {kind}: exit {r.returncode}: {r.stderr[-800:]}")
    fails += leases_left(soak, soak.work / "fsink-raw" / RAW_PREFIX, bucket, RAW_PREFIX)
    return kills, fails
