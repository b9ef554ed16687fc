"""Fleet export (issue 14): how the work splits over N simulated nodes, against one daemon alone.

A 4-rank gloo DCP save (fp32, Shard(0), Shard(1), 2-D blocks and replicated tensors) is staged twice: in
one shared ROOT, and dealt round-robin into N node-local ROOTs. One moto server (its own process) is the
sink and the exchange. Each node is a `FleetNode` in its own thread with its own clients, all started at
once (the markers are all there: "last marker" is t = 0). For each node: the bytes it read from the
exchange (other nodes' shards), the bytes it uploaded (raw part, export files), its busy time (wall time
less the time it slept waiting for others). The share is a node's bytes over the mean (1.0 = exactly 1/N).
"alone" is one daemon's work for the same step from the shared ROOT: `export_step` then
`FsspecSink.publish` (no raw upload); "fleet" is the time until `latest` names the step.

    python bench/bench_fleet.py                       # N = 2, 3, 4 on a ~64 MB checkpoint
    python bench/bench_fleet.py --mb 16 --nodes 2 --json bench/out/fleet.json

On a 2-core machine the N nodes share 2 cores and one Python S3 server: the absolute times say little,
the split is the figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_publish_s3 import BUCKET, KEY, REGION, SECRET, start_moto

MB = 1_000_000


def builder() -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    mb = int(os.environ.get("BENCH_FLEET_MB", "64"))
    rows = max(8, mb * MB // (16 * 1024 * 4))  # 16 tensors of rows x 1024 fp32
    codes = ["S0", "S1", "B01", "R"]
    return {f"model.layers.{i}.w": (torch.randn(rows, 1024, generator=g), codes[i % 4]) for i in range(16)}


def run_fleet(node_dirs: list[Path], url: str, shard: int) -> tuple[list[Any], float]:
    from stagerd.daemon.fleet.node import FleetNode, FleetOptions
    from stagerd.sinks.fetch import RemoteStore
    from stagerd.sinks.fsspec import FsspecSink

    results: list[Any] = [None] * len(node_dirs)

    def one(k: int) -> None:
        sink = FsspecSink.from_url(url)
        node = FleetNode(
            node_dirs[k],
            node_dirs[k].parent / ".stagerd" / "fleet",
            [sink],
            sink,
            RemoteStore.open(url),
            f"root-{k}",
            FleetOptions(max_shard_size=shard, wait_seconds=600, poll_seconds=0.05),
        )
        results[k] = node.run()

    t0 = time.monotonic()
    threads = [threading.Thread(target=one, args=(k,)) for k in range(len(node_dirs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=64, help="checkpoint size in MB")
    ap.add_argument("--nodes", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--shard-mb", type=float, default=2, help="max output file size in MB")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    os.environ["BENCH_FLEET_MB"] = str(args.mb)
    proc, endpoint = start_moto()
    os.environ.update(
        AWS_ACCESS_KEY_ID=KEY,
        AWS_SECRET_ACCESS_KEY=SECRET,
        AWS_DEFAULT_REGION=REGION,
        AWS_ENDPOINT_URL_S3=endpoint,
        AWS_EC2_METADATA_DISABLED="true",
    )
    import boto3

    from stagerd.contract import layout
    from stagerd.engine.export import export_step
    from stagerd.sinks.fsspec import FsspecSink
    from tests.dcp_fixtures import commit_step, dcp_save
    from tests.fleet_helpers import split_step

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
    shard = int(args.shard_mb * MB)
    out: dict[str, Any] = {"mb": args.mb, "shard_mb": args.shard_mb, "runs": []}
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as t:
        tmp, step = Path(t), 1
        model = tmp / "dcp"
        dcp_save(model, world=4, builder=builder)
        shared = tmp / "shared" / layout.step_dir_name(step)
        shutil.copytree(model, shared / "model")
        commit_step(shared, 4)
        t0 = time.monotonic()
        export_step(shared, max_shard_size=shard)
        FsspecSink.from_url(f"s3://{BUCKET}/alone").publish(shared / layout.EXPORT_DIR, step)
        alone = time.monotonic() - t0
        total_in = sum(p.stat().st_size for p in (shared / "model").iterdir())
        print(f"checkpoint {total_in / MB:.1f} MB in 4 shards; alone (export + upload): {alone:.2f} s")
        out["alone_seconds"], out["input_bytes"] = alone, total_in
        for n in args.nodes:
            dirs = split_step(shared, tmp / f"n{n}", n, link=True)
            res, wall = run_fleet(dirs, f"s3://{BUCKET}/fleet-{n}", shard)
            up = [r.bytes_uploaded for r in res]
            fetched = [r.bytes_fetched for r in res]
            busy = [r.seconds - r.waited for r in res]
            raw = [r.bytes_raw for r in res]
            print(f"N={n}: marker -> latest {wall:.2f} s (alone {alone:.2f} s)")
            for r, b in zip(res, busy, strict=True):
                print(
                    f"  node {r.node}: files {len(r.built)}, read remotely {r.bytes_fetched / MB:.1f} MB, "
                    f"uploaded {r.bytes_uploaded / MB:.1f} MB export + {r.bytes_raw / MB:.1f} MB raw, "
                    f"busy {b:.2f} s"
                )
            shares = {
                "fetched": [x * n / max(1, sum(fetched)) for x in fetched],
                "uploaded": [x * n / max(1, sum(up)) for x in up],
                "raw": [x * n / max(1, sum(raw)) for x in raw],
                "busy": [x * n / max(1e-9, sum(busy)) for x in busy],
            }
            for k, v in shares.items():
                print(f"  share of {k}: " + ", ".join(f"{x:.2f}" for x in v) + f" (max {max(v):.2f}x of 1/N)")
            out["runs"].append(
                {
                    "nodes": n,
                    "seconds": wall,
                    "fetched": fetched,
                    "uploaded": up,
                    "raw": raw,
                    "busy": busy,
                    "shares": shares,
                }
            )
    proc.terminate()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
