"""`stagerd consolidate SRC OUT` and `stagerd verify EXPORT_DIR [--against SRC]`."""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

from stagerd.errors import OutputError


def _threads_default() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def add_parser(sub: argparse._SubParsersAction, name: str) -> None:
    if name == "consolidate":
        p = sub.add_parser(
            "consolidate",
            help="turn DCP shards into HF safetensors + model.safetensors.index.json",
            description="Consolidate DCP HF shards (a step directory or a shard directory) into OUT.",
        )
        p.add_argument(
            "src", type=Path, metavar="SRC", help="step directory, or a directory of DCP HF shards"
        )
        p.add_argument("out", type=Path, metavar="OUT", help="output directory (must not exist, or be empty)")
        p.add_argument(
            "--dtype",
            help="bf16|fp16|fp32|keep: cast floating tensors (default: the marker's hint, else keep)",
        )
        p.add_argument("--keep-dtype", metavar="REGEX", help="tensor names matching REGEX are never cast")
        p.add_argument("--reference-index", type=Path, metavar="FILE", help="keep this index's file grouping")
        p.add_argument("--max-shard-size", default="5GB", help="pack files up to this size (default 5GB)")
        p.add_argument("--threads", type=int, default=_threads_default(), help="worker threads")
        p.set_defaults(func=run_consolidate)
    else:
        p = sub.add_parser(
            "verify",
            help="prove an export: index, headers, and (with --against) every byte",
            description="Re-read EXPORT_DIR and check it; with --against, compare every tensor with SRC.",
        )
        p.add_argument("export_dir", type=Path, metavar="EXPORT_DIR")
        p.add_argument("--against", type=Path, metavar="SRC", help="step directory or shard directory")
        p.add_argument("--threads", type=int, default=_threads_default())
        p.set_defaults(func=run_verify)


def _prepare_out(out: Path) -> Path:
    """A temp sibling of OUT to build in; OUT itself appears only complete, by rename."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise OutputError(
            "exists and is not an empty directory", path=out, hint="choose a new OUT or empty it"
        )
    tmp = out.parent / f".{out.name}.stagerd-tmp-{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as e:
        raise OutputError(f"cannot create the output directory: {e.strerror}", path=out) from None
    return tmp


def run_consolidate(args: argparse.Namespace) -> int:
    from stagerd.contract.layout import fsync_dir
    from stagerd.contract.reference_index import read_reference_index
    from stagerd.contract.sharding import parse_size
    from stagerd.engine.export import build_export, list_files, open_source
    from stagerd.ops.progress import progress

    t0 = time.monotonic()
    try:
        max_size = parse_size(args.max_shard_size)
    except ValueError as e:
        from stagerd.errors import ConfigError

        raise ConfigError(str(e)) from None
    source = open_source(args.src)
    dtype = source.target_dtype(args.dtype)
    reference = read_reference_index(args.reference_index) if args.reference_index else source.reference()
    tmp = _prepare_out(args.out)
    try:
        with progress(f"consolidate {args.src.name}", 0) as bar:
            build_export(
                source,
                tmp,
                dtype=dtype,
                keep_dtype=args.keep_dtype,
                reference=reference,
                max_shard_size=max_size,
                threads=args.threads,
                progress=bar,
            )
        if args.out.exists():
            args.out.rmdir()
        os.rename(tmp, args.out)
        fsync_dir(args.out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    files = list_files(args.out)
    total = sum(s for _, s in files)
    secs = time.monotonic() - t0
    rate = total / 1e9 / max(secs, 1e-9)
    print(f"wrote {len(files)} files, {total / 1e9:.3f} GB, to {args.out} in {secs:.2f} s ({rate:.2f} GB/s)")
    return 0


def run_verify(args: argparse.Namespace) -> int:
    from stagerd.engine.verify import verify_export
    from stagerd.ops.progress import progress

    with progress(f"verify {args.export_dir.name}", 0) as bar:
        r = verify_export(args.export_dir, args.against, threads=args.threads, progress=bar)
    against = f", every byte equal to {r.compared_with}" if r.compared_with else ""
    print(f"ok: {r.files} files, {r.tensors} tensors, {r.total_size} bytes{against}")
    return 0
