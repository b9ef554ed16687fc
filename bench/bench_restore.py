"""Restore and load (issue 13): `stagerd restore` vs `s3fs.get` vs boto3's TransferManager on the same raw
step, and `Stager.load` vs a plain `dcp.load` of the same step. Paired rounds, rotating order.

Restore: one raw step (4 equal model shards, an optimizer file, extras, the marker; `--size-gb` in all) is
published once with `FsspecSink.publish_raw` to one moto server (`ThreadedMotoServer` on 127.0.0.1, its
own process). Each round downloads `raw/step-N/` into a fresh directory with every contender, each built
before the clock starts. stagerd does more than the others: it reads the manifest and the listing first,
checks every file's sha256 while it downloads, fsyncs every file and directory, writes the journal and
lands the step atomically, marker last.

Load: a model of `--load-mib` fp32 parameters (8 tensors) and an AdamW-shaped optimizer state (two
moments per parameter) saved twice: by a single-process `Stager` (a stagerd step: safetensors under
`model/` and `optim/`, the marker) and by torch's own `dcp.save` of the same state dicts (DCP's format,
`FileSystemWriter`). Each round loads both into fresh tensors: `Stager.load` (step agreement, marker and
file-size checks, DCP's HF reader) and `dcp.load` of the `dcp.save` directory, alternating which goes
first; both read from the page cache (each is loaded once, untimed, first). Every load is checked equal
to what was saved, after the clock.

    python bench/bench_restore.py                                  # 2 GB, 3 rounds, 256 MiB model
    python bench/bench_restore.py --size-gb 0.5 --rounds 5 --json bench/out/restore.json

Ratios are the best peer's median over stagerd's median (>= 1: stagerd is faster), and the same ratio
round by round (median, min-max); a markdown table per part and the load average are printed at the end.
moto is a Python server: these rank clients against one slow server on this machine, they are not S3's
speed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KEY, SECRET, REGION, BUCKET = "bench-key", "bench-secret", "us-east-1", "bench"
MiB = 1 << 20

_SERVER = """
import sys
from moto.server import ThreadedMotoServer
s = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
s.start()
print(s.get_host_and_port()[1], flush=True)
sys.stdin.read()
"""


def start_moto() -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    return proc, f"http://127.0.0.1:{int(proc.stdout.readline())}"


def storage_options(endpoint: str) -> dict[str, Any]:
    return {"endpoint_url": endpoint, "key": KEY, "secret": SECRET, "client_kwargs": {"region_name": REGION}}


def make_step(root: Path, total: int) -> Path:
    """A committed raw step of about `total` bytes: 4 model shards, one optimizer file, extras, marker."""
    from stagerd.contract import commit_marker, layout

    step_dir = root / layout.step_dir_name(100)
    block = os.urandom(4 * MiB)
    files = {f"model/shard-{i:05d}-model-00001-of-00001.safetensors": total * 2 // 10 for i in range(1, 5)}
    files["optim/__0_0.distcp"] = total - sum(files.values())
    for rel, size in files.items():
        p = step_dir / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "wb") as f:
            left = size
            while left:
                left -= f.write(block[: min(left, len(block))])
            f.write(rel.encode())  # files differ
    (step_dir / "extras").mkdir()
    (step_dir / "extras" / "config.json").write_text('{"model_type": "bench"}\n')
    listed = [
        commit_marker.StagedFile(p.relative_to(step_dir).as_posix(), p.stat().st_size)
        for p in sorted(step_dir.rglob("*"))
        if p.is_file()
    ]
    commit_marker.write_marker(
        step_dir, commit_marker.CommitMarker(step=100, world_size=1, files=tuple(listed))
    )
    return step_dir


def publish(endpoint: str, step_dir: Path) -> None:
    import boto3

    from stagerd.sinks.fsspec import FsspecSink

    boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id=KEY, aws_secret_access_key=SECRET, region_name=REGION
    ).create_bucket(Bucket=BUCKET)
    sink = FsspecSink.from_url(f"s3://{BUCKET}/run", storage_options=storage_options(endpoint))
    sink.publish_raw(step_dir, 100)
    sink.close()


Run = Callable[[Path], None]


def open_stagerd(endpoint: str, workers: int) -> tuple[Run, Callable[[], None]]:
    from stagerd.cmd.restore import restore_raw
    from stagerd.sinks.fetch import RemoteStore

    store = RemoteStore.open(f"s3://{BUCKET}/run", workers=workers, storage_options=storage_options(endpoint))
    store.owns[0]._run(store.owns[0]._client)  # the session, as the command has it after its first request
    return (lambda out: restore_raw(store, out, 100, workers=workers)), store.close


def open_s3fs(endpoint: str, workers: int) -> tuple[Run, Callable[[], None]]:
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **storage_options(endpoint))
    fs.ls(BUCKET)

    def run(out: Path) -> None:
        fs.invalidate_cache()
        fs.get(f"{BUCKET}/run/raw/step-00000100/", str(out) + "/", recursive=True)

    return run, lambda: None


def open_boto3(endpoint: str, workers: int) -> tuple[Run, Callable[[], None]]:
    import boto3
    from boto3.s3.transfer import TransferConfig, create_transfer_manager
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=KEY,
        aws_secret_access_key=SECRET,
        region_name=REGION,
        config=Config(max_pool_connections=2 * workers),
    )
    client.list_objects_v2(Bucket=BUCKET, MaxKeys=1)
    config = TransferConfig(max_concurrency=workers, multipart_chunksize=16 * MiB)
    prefix = "run/raw/step-00000100/"

    def run(out: Path) -> None:
        keys = [o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix=prefix)["Contents"]]
        with create_transfer_manager(client, config) as tm:
            futures = []
            for k in keys:
                dst = out / k[len(prefix) :]
                dst.parent.mkdir(parents=True, exist_ok=True)
                futures.append(tm.download(BUCKET, k, str(dst)))
            for f in futures:
                f.result()

    return run, client.close


RESTORE = {"stagerd restore": open_stagerd, "s3fs.get": open_s3fs, "boto3 TransferManager": open_boto3}


def bench_restore(
    endpoint: str, work: Path, rounds: int, workers: int, expect: int
) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in RESTORE}
    names = list(RESTORE)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            out = work / f"out-{r}-{name.split()[0]}"
            run, close = RESTORE[name](endpoint, workers)
            try:
                t0 = time.perf_counter()
                run(out)
                times[name].append(time.perf_counter() - t0)
            finally:
                close()
            got = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
            assert got >= expect, f"{name} brought {got} bytes, expected {expect}"
            shutil.rmtree(out)
            print(f"  round {r + 1} {name}: {times[name][-1]:.2f} s", flush=True)
    return times


def bench_load(work: Path, rounds: int, mib: int) -> dict[str, list[float]]:
    """`Stager.load` of a stagerd step against torch's own `dcp.load` of a `dcp.save` of the same state
    dicts: the same tensors, each read back by its own writer's reader, both from the page cache."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from stagerd import Stager

    warnings.filterwarnings("ignore")
    n = mib * MiB // 4 // 8
    model = {f"layers.{i}.weight": torch.randn(n) for i in range(8)}
    optim = {f"state.{k}.{m}": torch.randn(n) for k in model for m in ("exp_avg", "exp_avg_sq")}
    root, peer = work / "load-root", work / "load-dcp"
    with Stager(root) as stager:
        stager.save(model, 1, optimizer_state=optim)
    dcp.save({"model": model, "optim": optim}, checkpoint_id=str(peer), no_dist=True)

    def fresh() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        return {k: torch.empty_like(v) for k, v in model.items()}, {
            k: torch.empty_like(v) for k, v in optim.items()
        }

    loader = Stager(root)  # built once, as a trainer builds it once per process

    def run_stagerd() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        m, o = fresh()
        loader.load(m, o, step=1)
        return m, o

    def run_dcp() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        m, o = fresh()
        dcp.load({"model": m, "optim": o}, checkpoint_id=str(peer), no_dist=True)
        return m, o

    runs = {"Stager.load": run_stagerd, "dcp.load": run_dcp}
    times: dict[str, list[float]] = {k: [] for k in runs}
    names = list(runs)
    for name in names:  # once each, untimed: imports, the page cache
        runs[name]()
    for r in range(rounds):
        for name in names[r % 2 :] + names[: r % 2]:
            t0 = time.perf_counter()
            m, o = runs[name]()
            times[name].append(time.perf_counter() - t0)
            assert all(torch.equal(m[k], model[k]) for k in model), name
            assert all(torch.equal(o[k], optim[k]) for k in optim), name
            del m, o
            print(f"  round {r + 1} {name}: {times[name][-1]:.3f} s", flush=True)
    loader.close()
    return times


def summary(times: dict[str, list[float]], ours: str) -> dict[str, Any]:
    med = {k: statistics.median(v) for k, v in times.items()}
    best = min((k for k in med if k != ours), key=lambda k: med[k])
    paired = [peer / mine for peer, mine in zip(times[best], times[ours], strict=True)]  # round by round
    return {
        "median_s": med,
        "min_max_s": {k: (min(v), max(v)) for k, v in times.items()},
        "best_peer": best,
        "ratio": med[best] / med[ours],
        "paired_ratio": {"median": statistics.median(paired), "min": min(paired), "max": max(paired)},
        "runs": times,
    }


def table(s: dict[str, Any], ours: str) -> str:
    """A markdown table of one part's figures, ready to paste."""
    rows = ["| contender | median s | min-max s |", "|---|---|---|"]
    for k, v in s["median_s"].items():
        lo, hi = s["min_max_s"][k]
        name = f"`{k}`"
        rows.append(f"| {name} | {f'**{v:.3f}**' if k == ours else f'{v:.3f}'} | {lo:.3f}-{hi:.3f} |")
    pr = s["paired_ratio"]
    rows.append("")
    rows.append(
        f"Ratio {s['best_peer']} / {ours}: {s['ratio']:.2f}x of the medians; paired, round by round: median "
        f"{pr['median']:.2f}x ({pr['min']:.2f}-{pr['max']:.2f}x). >= 1: stagerd is faster."
    )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=2.0, help="raw step size (default 2)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=8, help="parallel downloads for every contender")
    ap.add_argument("--load-mib", type=int, default=256, help="model size for the load bench (fp32 MiB)")
    ap.add_argument("--skip-restore", action="store_true")
    ap.add_argument("--skip-load", action="store_true")
    ap.add_argument("--json", type=Path, help="write the figures here")
    a = ap.parse_args()
    load_start = os.getloadavg()
    out: dict[str, Any] = {
        "size_gb": a.size_gb,
        "rounds": a.rounds,
        "workers": a.workers,
        "load_mib": a.load_mib,
    }
    with tempfile.TemporaryDirectory(prefix="bench-restore-") as tmp:
        work = Path(tmp)
        if not a.skip_restore:
            proc, endpoint = start_moto()
            try:
                total = int(a.size_gb * 1e9)
                step = make_step(work / "src", total)
                t0 = time.perf_counter()
                publish(endpoint, step)
                print(f"published {total / 1e9:.2f} GB raw in {time.perf_counter() - t0:.1f} s", flush=True)
                out["restore"] = summary(
                    bench_restore(endpoint, work, a.rounds, a.workers, total), "stagerd restore"
                )
            finally:
                proc.terminate()
                proc.wait()
        if not a.skip_load:
            out["load"] = summary(bench_load(work, a.rounds, a.load_mib), "Stager.load")
    load_end = os.getloadavg()
    out["load_average"] = {"start": load_start, "end": load_end}
    for part, ours in (("restore", "stagerd restore"), ("load", "Stager.load")):
        if part in out:
            print(f"\n{part}, {a.rounds} interleaved rounds:\n\n{table(out[part], ours)}")
    print("\nload average (1, 5, 15 min) at the start: {:.2f}, {:.2f}, {:.2f}".format(*load_start))
    print("load average (1, 5, 15 min) at the end: {:.2f}, {:.2f}, {:.2f}".format(*load_end))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
