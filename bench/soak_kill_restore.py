"""The crash soak's restore phase (`bench/soak_kill.py --restores N`): `stagerd restore URL OUT --export` of a
kept step from the file:// sink, S3 and the Hub, SIGKILLed at a random moment or at the crash point
`restore.piece:K` (1 to 3 kills in a chain into one OUT), then run again to the end.

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
            if how == "time":
                try:
                    p.wait(rng.uniform(0.1, 1.5))
                except subprocess.TimeoutExpired:
                    p.kill()
            _, err = p.communicate(timeout=300)
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
    fails += leases_left(soak)
    return kills, fails


def leases_left(soak: Soak) -> list[str]:
    fails = []
    d = soak.fsink / PREFIX / "restoring"
    if d.exists():
        fails.append(f"file sink: restoring/ left: {sorted(p.name for p in d.iterdir())[:10]}")
    client: Any = soak.s3.client()
    page = client.list_objects_v2(Bucket=soak.bucket, Prefix=f"{PREFIX}/restoring/")
    keys = [o["Key"] for o in page.get("Contents", [])]
    if keys:
        fails.append(f"S3: leases left: {keys[:10]}")
    return fails
