"""What the depth check costs the trainer's read of a DCP `optim/.metadata`, against the bare unpickle.

The `.metadata` is the one a 2-rank DCP save of an Adam-like optimizer state writes (DCP's own dataclasses,
pickled as DCP pickles them: tests/training/optim_metadata.py), of `--chunks` chunks. Each round times,
in alternating order on the same bytes: the bare allowlist unpickle (`_AllowlistUnpickler.load`, what
`SafeFileSystemReader` ran before) and `read_dcp_metadata` (the depth scan, then that unpickle); the scan
alone in C is timed in the same rounds. The scan in Python (the fallback without a C compiler) is timed
`--python-rounds` times.

    python bench/bench_pickle_depth.py --chunks 102400 --rounds 7
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from stagerd.contract import pickle_depth
from stagerd.training.safe_metadata import _AllowlistUnpickler, read_dcp_metadata
from tests.training.optim_metadata import optim_metadata_bytes


def _timed(fn) -> float:
    gc.collect()
    t0 = time.perf_counter()
    out = fn()
    took = time.perf_counter() - t0
    del out
    return took


def _row(name: str, got: list[float], ratios: list[float] | None) -> str:
    ratio = f"{statistics.median(ratios):.3f}x ({min(ratios):.3f}-{max(ratios):.3f})" if ratios else "-"
    return f"| {name} | {statistics.median(got):.3f} | {min(got):.3f} | {max(got):.3f} | {ratio} |"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=102_400)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--python-rounds", type=int, default=1)
    args = ap.parse_args()
    data = optim_metadata_bytes(args.chunks, args.ranks)
    where = "optim/.metadata"
    compiled = pickle_depth._pickle_depth is not None

    def bare() -> object:
        return _AllowlistUnpickler(data, where).load()

    def checked() -> object:
        return read_dcp_metadata(data, where)

    bare_s: list[float] = []
    checked_s: list[float] = []
    scan_s: list[float] = []
    for r in range(args.rounds):
        first, second = (bare, checked) if r % 2 == 0 else (checked, bare)
        a, b = _timed(first), _timed(second)
        bare_s.append(a if first is bare else b)
        checked_s.append(b if first is bare else a)
        scan_s.append(_timed(lambda: pickle_depth.check_depth(data)))
    py_s = [_timed(lambda: pickle_depth.scan_py(data)) for _ in range(args.python_rounds)]
    over = [c / b for c, b in zip(checked_s, bare_s, strict=True)]
    print(
        f"`.metadata` of {args.chunks} chunks ({args.ranks} ranks): {len(data) / 1e6:.1f} MB; {args.rounds} "
        f"paired rounds; C scan {'built' if compiled else 'ABSENT (Python fallback)'}; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print("| path | median s | min | max | vs bare unpickle, median of paired ratios (range) |")
    print("|---|---|---|---|---|")
    print(_row("bare allowlist unpickle (before)", bare_s, None))
    print(_row("depth scan + allowlist unpickle (`read_dcp_metadata`)", checked_s, over))
    alone = [s / b for s, b in zip(scan_s, bare_s, strict=True)]
    print(_row("depth scan alone (C)" if compiled else "depth scan alone", scan_s, alone))
    if py_s:
        print(_row("depth scan alone, Python fallback (`scan_py`)", py_s, None))


if __name__ == "__main__":
    main()
