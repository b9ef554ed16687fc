"""S3 publish throughput: stagerd's FsspecSink vs boto3's TransferManager (tuned) vs `s3fs.put`.

All three upload the same export (4 equal safetensors-sized files and an index, `--size-gb` in total, warm
page cache) to the same moto server, which runs in its own process (`ThreadedMotoServer` on 127.0.0.1) so
that it does not share the client's GIL. Every contender starts from an empty bucket prefix. stagerd does
more work than the other two: sha256 of every file and of every part (sent as S3 checksums), a verification
HEAD per file, the manifest and `latest`.

    python bench/bench_publish_s3.py --size-gb 2
    python bench/bench_publish_s3.py --size-gb 0.5 --repeat 3 --json bench/out/publish_s3.json

Target: stagerd >= 0.9x the best of the other two. moto is a Python server and is very likely the
bottleneck here: these figures rank clients against one slow server, they are not S3's speed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KEY, SECRET, REGION = "bench-key", "bench-secret", "us-east-1"
MiB = 1 << 20

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


def make_export(root: Path, total: int) -> Path:
    """4 equal shards of pseudo-random bytes (incompressible, cheap to make) and a small index."""
    root.mkdir(parents=True, exist_ok=True)
    block = os.urandom(4 * MiB)
    each = total // 4
    for i in range(4):
        p = root / f"model-{i + 1:05d}-of-00004.safetensors"
        with open(p, "wb") as f:
            left = each
            while left:
                n = min(left, len(block))
                f.write(block[:n])
                left -= n
        # one distinct byte per file, so the four files differ
        with open(p, "r+b") as f:
            f.write(bytes([i]))
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 4 * each}}))
    return root


def warm(export: Path) -> int:
    total = 0
    for p in sorted(export.iterdir()):
        with open(p, "rb", buffering=0) as f:
            while b := f.read(16 * MiB):
                total += len(b)
    return total


def boto_client(endpoint: str, pool: int) -> object:
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=KEY,
        aws_secret_access_key=SECRET,
        region_name=REGION,
        config=Config(max_pool_connections=pool),
    )


def run_stagerd(export: Path, endpoint: str, bucket: str, prefix: str, part: int, conc: int) -> None:
    from stagerd.sinks.fsspec import FsspecSink

    opts = {"endpoint_url": endpoint, "key": KEY, "secret": SECRET, "client_kwargs": {"region_name": REGION}}
    sink = FsspecSink.from_url(
        f"s3://{bucket}/{prefix}", storage_options=opts, part_size=part, max_concurrency=conc
    )
    try:
        res = sink.publish(export, 1)
        assert not res.skipped and res.bytes_uploaded == res.bytes_total
    finally:
        sink.close()


def run_transfer_manager(export: Path, endpoint: str, bucket: str, prefix: str, part: int, conc: int) -> None:
    from boto3.s3.transfer import TransferConfig, create_transfer_manager

    client = boto_client(endpoint, 2 * conc)
    config = TransferConfig(
        multipart_threshold=part, multipart_chunksize=part, max_concurrency=conc, use_threads=True
    )
    with create_transfer_manager(client, config) as tm:
        futures = [tm.upload(str(p), bucket, f"{prefix}/{p.name}") for p in sorted(export.iterdir())]
        for f in futures:
            f.result()


def run_s3fs_put(export: Path, endpoint: str, bucket: str, prefix: str, part: int, conc: int) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(
        key=KEY,
        secret=SECRET,
        endpoint_url=endpoint,
        client_kwargs={"region_name": REGION},
        skip_instance_cache=True,
    )
    fs.put(f"{export}/", f"{bucket}/{prefix}/", recursive=True)


CONTENDERS: dict[str, Callable[..., None]] = {
    "stagerd": run_stagerd,
    "boto3 TransferManager": run_transfer_manager,
    "s3fs.put": run_s3fs_put,
}
if os.environ.get("BENCH_ONLY"):
    CONTENDERS = {k: v for k, v in CONTENDERS.items() if k.startswith(os.environ["BENCH_ONLY"])}


def empty_bucket(client: object, bucket: str) -> None:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket)  # type: ignore[attr-defined]
    for page in pages:
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys})  # type: ignore[attr-defined]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=2.0, help="export size in GB (default 2)")
    ap.add_argument("--part-mib", type=int, default=16, help="part size for stagerd and TransferManager")
    ap.add_argument("--concurrency", type=int, default=8, help="parts in flight (stagerd, TransferManager)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per contender; the best is reported")
    ap.add_argument("--workdir", type=Path, help="where to write the export (default: a temp dir)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()

    total = int(args.size_gb * 1e9)
    part, conc = args.part_mib * MiB, args.concurrency
    proc, endpoint = start_moto()
    try:
        with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
            export = make_export(Path(tmp) / "export", total)
            nbytes = warm(export)
            client = boto_client(endpoint, 4)
            bucket = "bench"
            client.create_bucket(Bucket=bucket)  # type: ignore[attr-defined]
            results: dict[str, list[float]] = {name: [] for name in CONTENDERS}
            for r in range(args.repeat):
                for name, fn in CONTENDERS.items():
                    warm(export)
                    t0 = time.perf_counter()
                    fn(export, endpoint, bucket, f"run{r}-{name.split()[0]}", part, conc)
                    results[name].append(time.perf_counter() - t0)
                    empty_bucket(client, bucket)
                    print(f"  run {r + 1} {name:22s} {results[name][-1]:7.2f} s", flush=True)
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=30)

    best = {name: min(ts) for name, ts in results.items()}
    rate = {name: nbytes / t / 1e6 for name, t in best.items()}
    baseline = max(v for k, v in rate.items() if k != "stagerd")
    print(
        f"\nS3 publish of {nbytes / 1e9:.2f} GB (4 shards + index) to moto, part {args.part_mib} MiB, "
        f"{conc} in flight, {os.cpu_count()} CPUs, best of {args.repeat}"
    )
    print(f"{'client':24s} {'seconds':>8s} {'MB/s':>8s} {'vs best other':>14s}")
    for name in CONTENDERS:
        print(f"{name:24s} {best[name]:8.2f} {rate[name]:8.1f} {rate[name] / baseline:13.2f}x")
    verdict = rate["stagerd"] / baseline
    print(f"\nstagerd / best of the others = {verdict:.2f}x (target >= 0.90x)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        out = {"bytes": nbytes, "part_mib": args.part_mib, "concurrency": conc, "seconds": results}
        args.json.write_text(json.dumps({**out, "mb_per_s": rate, "ratio": verdict}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
