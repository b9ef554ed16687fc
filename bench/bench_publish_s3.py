"""S3 publish: stagerd's FsspecSink vs boto3's TransferManager vs `s3fs.put`, paired, at several sizes.

Every case is an export in the warm page cache (4 equal safetensors-sized shards and an index, or
`--small-files` files of 1 MB each) uploaded to one moto server (`ThreadedMotoServer` on 127.0.0.1, in its
own process so that it does not share the client's GIL). A round runs every contender once on the case, in
an order that rotates from round to round; each run starts from an empty bucket and from a client built
before the clock starts (no connection open yet), as the daemon holds its sink open across steps.
stagerd does more than the other two: the sha256 of every file for the manifest, CRC32 part checksums
the store verifies, verification of every file before the manifest, the manifest (`If-None-Match: *`)
and `latest`.

    python bench/bench_publish_s3.py                    # 0.1, 0.5 and 2 GB, and 20 small files; 3 rounds
    python bench/bench_publish_s3.py --sizes 0.5 --small-files 0 --rounds 5 --json bench/out/s3.json
    python bench/bench_publish_s3.py --sizes 0.5 --small-files 0 --rounds 1 --timeline
    python bench/bench_publish_s3.py --sizes 0.5,2 --small-files 0 --unsigned-payload  # as over https

The ratio is the best peer's median time over stagerd's median time (>= 1: faster than both); the
per-round ratio (stagerd against the best peer of the same round) is given as median and min-max.
Target: >= 0.90x at every size. moto is a Python server and is very likely the bottleneck: these rank
clients against one slow server on this machine, they are not S3's speed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KEY, SECRET, REGION = "bench-key", "bench-secret", "us-east-1"
MiB = 1 << 20
BUCKET = "bench"

_SERVER = """
import sys, time
from moto.server import ThreadedMotoServer
s = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
s.start()
print(s.get_host_and_port()[1], flush=True)
sys.stdin.read()
"""


def start_moto() -> tuple[subprocess.Popen[str], str]:
    """moto in a child process; it exits when our stdin pipe closes."""
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    port = int(proc.stdout.readline())
    return proc, f"http://127.0.0.1:{port}"


def _write(p: Path, size: int, block: bytes, tag: int) -> None:
    with open(p, "wb") as f:
        left = size
        while left:
            n = min(left, len(block))
            f.write(block[:n])
            left -= n
    with open(p, "r+b") as f:  # one distinct byte per file, so the files differ
        f.write(tag.to_bytes(2, "big"))


def make_export(root: Path, total: int) -> Path:
    """4 equal shards of pseudo-random bytes (incompressible, cheap to make) and a small index."""
    root.mkdir(parents=True, exist_ok=True)
    block = os.urandom(4 * MiB)
    each = total // 4
    for i in range(4):
        _write(root / f"model-{i + 1:05d}-of-00004.safetensors", each, block, i)
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 4 * each}}))
    return root


def make_small_export(root: Path, count: int) -> Path:
    """`count` files of 1 MB: an adapter's shards, configs, a tokenizer."""
    root.mkdir(parents=True, exist_ok=True)
    block = os.urandom(MiB)
    for i in range(count):
        _write(root / f"part-{i:03d}.bin", 1_000_000, block, i)
    return root


def warm(export: Path) -> int:
    total = 0
    for p in sorted(export.iterdir()):
        with open(p, "rb", buffering=0) as f:
            while b := f.read(16 * MiB):
                total += len(b)
    return total


def boto_client(endpoint: str, pool: int) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=KEY,
        aws_secret_access_key=SECRET,
        region_name=REGION,
        config=Config(max_pool_connections=pool, **S3_CONFIG),
    )


# With --warm-clients every contender's client makes one listing before the clock (a daemon's sink
# has made its first request long before a step): what is left is the publish, not the first connection.
# With --after-a-step every contender uploads a one-file step with the same client before the clock, as
# a daemon's sink has published the step before: what is timed is a step in the steady state.
WARM: dict[str, Any] = {"clients": False, "step": None}
# With --unsigned-payload every client sends UNSIGNED-PAYLOAD, as botocore does over https when a checksum
# header is present: no client hashes request bodies for SigV4, so this is the hashing real S3 costs.
S3_CONFIG: dict[str, Any] = {}

# A contender is built, untimed, for one run: (endpoint, prefix, part, concurrency) -> (upload, close).
Run = Callable[[Path], None]


def open_stagerd(endpoint: str, prefix: str, part: int, conc: int) -> Any:
    from stagerd.sinks.fsspec import FsspecSink

    opts = {"endpoint_url": endpoint, "key": KEY, "secret": SECRET, "client_kwargs": {"region_name": REGION}}
    opts["config_kwargs"] = dict(S3_CONFIG)
    url = f"s3://{BUCKET}/{prefix}"
    sink = FsspecSink.from_url(url, storage_options=opts, part_size=part, max_concurrency=conc)
    backend = sink._backend
    backend._run(backend._client)  # type: ignore[attr-defined]  # the session, as a running daemon has it
    return sink


def stagerd(endpoint: str, prefix: str, part: int, conc: int) -> tuple[Run, Callable[[], None]]:
    sink = open_stagerd(endpoint, prefix, part, conc)
    if WARM["clients"]:
        sink._backend.list("warm")
    if WARM["step"] is not None:
        sink.publish(WARM["step"], 0)

    def run(export: Path) -> None:
        res = sink.publish(export, 1)
        assert not res.skipped and res.bytes_uploaded == res.bytes_total

    return run, sink.close


def transfer_manager(endpoint: str, prefix: str, part: int, conc: int) -> tuple[Run, Callable[[], None]]:
    from boto3.s3.transfer import TransferConfig, create_transfer_manager

    client = boto_client(endpoint, 2 * conc)
    if WARM["clients"]:
        client.list_objects_v2(Bucket=BUCKET, Prefix="warm/")
    config = TransferConfig(
        multipart_threshold=part, multipart_chunksize=part, max_concurrency=conc, use_threads=True
    )
    if WARM["step"] is not None:
        with create_transfer_manager(client, config) as tm:
            for p in sorted(WARM["step"].iterdir()):
                tm.upload(str(p), BUCKET, f"{prefix}/step-0/{p.name}").result()

    def run(export: Path) -> None:
        with create_transfer_manager(client, config) as tm:
            futures = [tm.upload(str(p), BUCKET, f"{prefix}/{p.name}") for p in sorted(export.iterdir())]
            for f in futures:
                f.result()

    return run, client.close


def s3fs_put(endpoint: str, prefix: str, part: int, conc: int) -> tuple[Run, Callable[[], None]]:
    import s3fs
    from fsspec.asyn import sync

    opts = {"key": KEY, "secret": SECRET, "endpoint_url": endpoint, "client_kwargs": {"region_name": REGION}}
    fs = s3fs.S3FileSystem(skip_instance_cache=True, config_kwargs=dict(S3_CONFIG), **opts)
    s3 = sync(fs.loop, fs.set_session)
    if WARM["clients"]:
        sync(fs.loop, s3.list_objects_v2, Bucket=BUCKET, Prefix="warm/")
    if WARM["step"] is not None:
        fs.put(f"{WARM['step']}/", f"{BUCKET}/{prefix}/step-0/", recursive=True)

    def run(export: Path) -> None:
        fs.put(f"{export}/", f"{BUCKET}/{prefix}/", recursive=True)

    return run, lambda: None


CONTENDERS: dict[str, Callable[[str, str, int, int], tuple[Run, Callable[[], None]]]] = {
    "stagerd": stagerd,
    "boto3 TransferManager": transfer_manager,
    "s3fs.put": s3fs_put,
}
PEERS = [n for n in CONTENDERS if n != "stagerd"]


def empty_bucket(client: Any) -> None:
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=BUCKET, Delete={"Objects": keys})


def timeline(export: Path, endpoint: str, part: int, conc: int) -> None:
    """One stagerd publish with every request's start, end and operation (botocore's call events)."""
    sink = open_stagerd(endpoint, "timeline", part, conc)
    client = sink._backend._run(sink._backend._client)
    events: list[tuple[float, float, str]] = []

    def before(context: dict[str, Any], **_: Any) -> None:
        context["bench_t0"] = time.perf_counter()

    def after(model: Any, context: dict[str, Any], **_: Any) -> None:
        events.append((context["bench_t0"] - t0, time.perf_counter() - t0, model.name))

    client.meta.events.register("before-call.s3", before)
    client.meta.events.register("after-call.s3", after)
    t0 = time.perf_counter()
    sink.publish(export, 1)
    total = time.perf_counter() - t0
    sink.close()
    parts = [e for e in events if e[2] == "UploadPart"]
    print(f"\n  one stagerd publish, {total:.3f} s; its requests (start -> end, duration):")
    if parts:
        first, last = min(p[0] for p in parts), max(p[1] for p in parts)
        mean = statistics.mean(p[1] - p[0] for p in parts)
        events = [e for e in events if e[2] != "UploadPart"]
        events.append((first, last, f"UploadPart x{len(parts)}, first start to last end (mean {mean:.3f} s)"))
    for s, e, name in sorted(events):
        print(f"  {s:7.3f} -> {e:7.3f}  {e - s:6.3f} s  {name}")


SERVER: dict[str, Any] = {}


def _cpu() -> float:
    """This process's CPU seconds, every thread (the client's own work: hashing, signing, copying)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _server_cpu() -> float:
    """The moto server process's CPU seconds."""
    t = SERVER["proc"].cpu_times()
    return float(t.user + t.system)


def bench_case(
    label: str, export: Path, endpoint: str, part: int, conc: int, rounds: int, client: Any
) -> dict[str, Any]:
    nbytes = warm(export)
    times: dict[str, list[float]] = {n: [] for n in CONTENDERS}
    cpu: dict[str, list[float]] = {n: [] for n in CONTENDERS}
    server_cpu: dict[str, list[float]] = {n: [] for n in CONTENDERS}
    names = list(CONTENDERS)
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            run, close = CONTENDERS[name](endpoint, f"r{r}-{name.split()[0]}", part, conc)
            warm(export)
            c0, m0 = _cpu(), _server_cpu()
            t0 = time.perf_counter()
            run(export)
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(_cpu() - c0)
            server_cpu[name].append(_server_cpu() - m0)
            close()
            empty_bucket(client)
        line = "  ".join(
            f"{n.split()[0]} {times[n][-1]:6.2f} s (cpu {cpu[n][-1]:.2f} s, server {server_cpu[n][-1]:.2f} s)"
            for n in names
        )
        print(f"  {label} round {r + 1}: {line}", flush=True)
    med = {n: statistics.median(ts) for n, ts in times.items()}
    best_peer = min(med[n] for n in PEERS)
    per_round = [min(times[n][r] for n in PEERS) / times["stagerd"][r] for r in range(rounds)]
    return {
        "case": label,
        "bytes": nbytes,
        "seconds": times,
        "client_cpu_seconds": cpu,
        "server_cpu_seconds": server_cpu,
        "median": med,
        "ratio": best_peer / med["stagerd"],
        "ratio_per_round": per_round,
    }


def report(results: list[dict[str, Any]], rounds: int) -> None:
    print(
        f"\nmedian seconds (min-max) over {rounds} paired rounds; ratio = best peer median / stagerd median"
    )
    head = f"{'case':10s} " + " ".join(f"{n:>22s}" for n in CONTENDERS) + f" {'ratio':>7s} {'per round':>17s}"
    print(head)
    for res in results:
        cells = []
        for n in CONTENDERS:
            ts = res["seconds"][n]
            cells.append(f"{res['median'][n]:6.2f} ({min(ts):.2f}-{max(ts):.2f})".rjust(22))
        pr = res["ratio_per_round"]
        spread = f"{statistics.median(pr):.2f} ({min(pr):.2f}-{max(pr):.2f})"
        print(f"{res['case']:10s} " + " ".join(cells) + f" {res['ratio']:6.2f}x {spread:>17s}")
    worst = min(r["ratio"] for r in results)
    print(f"\nworst ratio {worst:.2f}x (target >= 0.90x); load average now {os.getloadavg()[0]:.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="0.1,0.5,2", help="export sizes in GB, comma-separated")
    ap.add_argument("--small-files", type=int, default=20, help="also a case of N files of 1 MB (0: none)")
    ap.add_argument("--part-mib", type=int, default=16, help="part size for stagerd and TransferManager")
    ap.add_argument("--concurrency", type=int, default=8, help="parts in flight (stagerd, TransferManager)")
    ap.add_argument("--rounds", type=int, default=3, help="paired rounds per case (at least 3 for a spread)")
    ap.add_argument("--timeline", action="store_true", help="print one stagerd publish's requests per case")
    ap.add_argument("--warm-clients", action="store_true", help="one untimed request per client first")
    ap.add_argument(
        "--after-a-step", action="store_true", help="each client uploads a one-file step untimed first"
    )
    ap.add_argument(
        "--unsigned-payload", action="store_true", help="no client signs body hashes (as over https)"
    )
    ap.add_argument("--workdir", type=Path, help="where to write the exports (default: a temp dir)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()

    part, conc = args.part_mib * MiB, args.concurrency
    WARM["clients"] = args.warm_clients
    if args.unsigned_payload:
        S3_CONFIG["s3"] = {"payload_signing_enabled": False}
    cases: list[tuple[str, Callable[[Path], Path]]] = [
        (f"{gb:g} GB", lambda root, gb=gb: make_export(root, int(gb * 1e9)))
        for gb in (float(x) for x in args.sizes.split(",") if x)
    ]
    if args.small_files:
        cases.append((f"{args.small_files} x 1 MB", lambda root: make_small_export(root, args.small_files)))
    print(
        f"S3 publish to moto, part {args.part_mib} MiB, {conc} in flight, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.2f} at start"
        + (", clients warmed" if args.warm_clients else "")
        + (", after a step" if args.after_a_step else "")
        + (", unsigned payloads" if args.unsigned_payload else "")
    )
    proc, endpoint = start_moto()
    step_dir = tempfile.TemporaryDirectory(dir=args.workdir)
    if args.after_a_step:
        WARM["step"] = make_small_export(Path(step_dir.name) / "step-0", 1)
    import psutil

    SERVER["proc"] = psutil.Process(proc.pid)
    results = []
    try:
        client = boto_client(endpoint, 4)
        client.create_bucket(Bucket=BUCKET)
        for label, make in cases:
            with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
                export = make(Path(tmp) / "export")
                if args.timeline:
                    warm(export)
                    timeline(export, endpoint, part, conc)
                    empty_bucket(client)
                results.append(bench_case(label, export, endpoint, part, conc, args.rounds, client))
    finally:
        step_dir.cleanup()
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=60)
    report(results, args.rounds)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"part_mib": args.part_mib, "concurrency": conc, "cpus": os.cpu_count()}
        args.json.write_text(json.dumps({**meta, "cases": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
