"""Hub publish throughput: `HubSink.publish` of a synthetic export to the Hub-protocol test server.

    python bench/bench_publish_hub.py --size 2GB --shards 4

Side by side: a bare `HfApi.create_commit` of the same files to a fresh repo (the client alone, no
stagerd hashing, planning or verification), and the idempotent re-run (nothing to send). Both ends run on
this machine, so the figures measure the client and the loopback server, not a network. The client
takes the LFS path (`HF_HUB_DISABLE_XET=1`); `bench_publish_hub_xet.py` measures the Xet path.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.hubserver import HubConfig, HubServer, disable_xet

disable_xet()
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

from huggingface_hub import CommitOperationAdd, HfApi  # noqa: E402
from huggingface_hub.utils import disable_progress_bars  # noqa: E402

from stagerd.sinks.hub import HubSink, scan_export  # noqa: E402

_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}


def parse_size(text: str) -> int:
    t = text.strip().upper()
    for unit, mult in sorted(_UNITS.items(), key=lambda kv: -len(kv[0])):
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * mult)
    return int(t)


def write_shard(path: Path, nbytes: int, block: bytes, seed: int) -> None:
    """A valid safetensors file: one BF16 tensor of `nbytes`, filled from a random block (per-shard salt)."""
    nbytes -= nbytes % 2
    header = json.dumps(
        {
            "__metadata__": {"format": "pt"},
            "w": {"dtype": "BF16", "shape": [nbytes // 2], "data_offsets": [0, nbytes]},
        }
    ).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.write(seed.to_bytes(8, "little"))
        left = nbytes - 8
        while left > 0:
            n = min(left, len(block))
            f.write(block[:n])
            left -= n


def make_export(out: Path, total: int, shards: int) -> Path:
    out.mkdir(parents=True)
    block = random.Random(0).randbytes(64 << 20)
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    for i, name in enumerate(names):
        write_shard(out / name, total // shards, block, i)
    index = {"metadata": {"total_size": total}, "weight_map": {f"w{i}": n for i, n in enumerate(names)}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    (out / "config.json").write_text(json.dumps({"model_type": "bench"}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="2GB", help="export size, e.g. 512MB, 2GB (default 2GB)")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument(
        "--threads", type=int, default=5, help="concurrent LFS uploads (huggingface_hub num_threads)"
    )
    ap.add_argument("--chunk", default="64MiB", help="multipart part size the server hands out")
    ap.add_argument("--dir", default=None, help="work dir (default: a temp dir, removed afterwards)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = ap.parse_args()
    disable_progress_bars()

    work = Path(tempfile.mkdtemp(prefix="bench-hub-", dir=args.dir))
    try:
        size = parse_size(args.size)
        export = make_export(work / "export", size, args.shards)
        total = sum(p.stat().st_size for p in export.iterdir())
        chunk = parse_size(args.chunk)
        config = HubConfig(multipart_threshold=chunk, multipart_chunk_size=chunk)
        rows: dict[str, float] = {}
        with HubServer(work / "server", config=config) as hub:
            t = time.perf_counter()
            scan_export(export)
            rows["sha256 of the export (warm cache)"] = time.perf_counter() - t

            api = HfApi(endpoint=hub.endpoint, token=hub.token)
            api.create_repo("bench/bare", private=True)
            ops = [CommitOperationAdd(p.name, str(p)) for p in sorted(export.iterdir())]
            t = time.perf_counter()
            api.create_commit("bench/bare", ops, commit_message="bare", num_threads=args.threads)
            rows["bare HfApi.create_commit"] = time.perf_counter() - t

            sink = HubSink.from_url(
                "hf://bench/model", token=hub.token, endpoint=hub.endpoint, num_threads=args.threads
            )
            t = time.perf_counter()
            result = sink.publish(export, 1000)
            rows["HubSink.publish (hash, commit, verify, tag)"] = time.perf_counter() - t
            assert not result.skipped and hub.stats.commits["bench/model"] == 1

            t = time.perf_counter()
            assert sink.publish(export, 1000).skipped
            rows["HubSink.publish re-run (no-op)"] = time.perf_counter() - t

        if args.json:
            print(json.dumps({"bytes": total, "shards": args.shards, "seconds": rows}))
            return
        print(
            f"export: {total / 1e9:.2f} GB in {args.shards} shards, LFS part size {chunk >> 20} MiB, "
            f"{args.threads} upload threads, {os.cpu_count()} CPUs"
        )
        for name, secs in rows.items():
            print(f"  {name:<46} {secs:7.2f} s  {total / secs / 1e6:8.0f} MB/s")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
