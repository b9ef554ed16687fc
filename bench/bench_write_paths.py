"""Why a cast export right after another export was slow: the ways to write 1 GiB durably, measured apart
from the engine. Each case writes --mib MiB of new data into a new file and fsyncs it, in its own process
(run under `perf stat` when perf is there, for the kernel's own counters), rounds interleaved:

- `pwrite, fresh pages`: 512 KiB pwrites into the page cache once the memory freed before has been handed
  back to the host (`settle`: a daemon's steady state, the last big free seconds ago), so the new page
  cache comes from the machine's general free pool (what an export gets right after another export);
- `pwrite, reused pages`: the same right after a cached file of the same size was deleted, so the new
  page cache reuses pages freed a moment ago (what "the cast alone, with keep's output deleted" got);
- `pwrite 32 KiB, fresh pages` and `copy_file_range, fresh pages` (from a cached file of the same size):
  the same fresh pool, written in small pieces (the kernel then makes small folios);
- `pwrite + drop-behind`: fresh pool, but the writer waits for writeback of what is older than a 64 MiB
  window and drops it from the page cache (`sync_file_range` + `POSIX_FADV_DONTNEED`), so the pages are
  recycled at once and the file never holds more than the window;
- `pwrite + sync_file_range pacing`: the same waits, without the drop (pacing alone);
- `O_DIRECT`: aligned 4 MiB writes from one reused buffer, no page cache at all;
- `mmap + madvise`: the file mapped shared, filled by memcpy, `MADV_SEQUENTIAL`, `msync`.

    python bench/bench_write_paths.py --mib 1024 --repeat 5 --dir bench/data

Prints a table of wall and CPU seconds (medians, min-max) with the tracepoint counts of
`balance_dirty_pages` (dirty throttling), `mm_filemap_add_to_page_cache` (page-cache folios allocated),
`mm_vmscan_direct_reclaim_begin` and the `page_reporting` module's count of free memory handed back to
the host meanwhile, where the kernel has that module.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROUND = 512 << 10
WINDOW = 64 << 20
DIRECT = 4 << 20
EVENTS = (
    "writeback:balance_dirty_pages",
    "filemap:mm_filemap_add_to_page_cache",
    "vmscan:mm_vmscan_direct_reclaim_begin",
    "kmem:mm_page_alloc",
)
LARGE = "order>=4"  # a filter on the last event: page-cache folios of 64 KiB and more
CASES = (
    "pwrite, fresh pages",
    "pwrite, reused pages",
    "pwrite 32 KiB, fresh pages",
    "copy_file_range, fresh pages",
    "pwrite + drop-behind",
    "pwrite + sync_file_range pacing",
    "O_DIRECT",
    "mmap + madvise",
)


def _sfr():
    import ctypes

    fn = ctypes.CDLL("libc.so.6", use_errno=True).sync_file_range
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


def write_case(case: str, path: str, size: int) -> None:
    """The measured part: runs in its own process (`--child`)."""
    data = os.urandom(ROUND)
    if case == "O_DIRECT":
        buf = mmap.mmap(-1, DIRECT)  # page-aligned, reused for every write
        for i in range(0, DIRECT, ROUND):
            buf[i : i + ROUND] = data
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
        for off in range(0, size, DIRECT):
            os.pwrite(fd, buf, off)
        os.fsync(fd)
        os.close(fd)
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    os.posix_fallocate(fd, 0, size)
    if case == "copy_file_range, fresh pages":
        src = os.open(Path(path).with_name("source.bin"), os.O_RDONLY)
        done = 0
        while done < size:
            done += os.copy_file_range(src, fd, size - done, done, done)
        os.close(src)
        os.fsync(fd)
        os.close(fd)
        return
    if case == "pwrite 32 KiB, fresh pages":
        small = memoryview(data)[: 32 << 10]
        for off in range(0, size, len(small)):
            os.pwrite(fd, small, off)
        os.fsync(fd)
        os.close(fd)
        return
    if case == "mmap + madvise":
        m = mmap.mmap(fd, size)
        m.madvise(mmap.MADV_SEQUENTIAL)
        for off in range(0, size, ROUND):
            m[off : off + ROUND] = data
        m.flush()
        m.close()
        os.fsync(fd)
        os.close(fd)
        return
    sfr = _sfr()
    pace = case in ("pwrite + drop-behind", "pwrite + sync_file_range pacing")
    done = 0
    for off in range(0, size, ROUND):
        os.pwrite(fd, data, off)
        if pace and (off + ROUND) % (8 << 20) == 0:
            sfr(fd, off + ROUND - (8 << 20), 8 << 20, 2)  # SYNC_FILE_RANGE_WRITE
            while off + ROUND - done > WINDOW:
                sfr(fd, done, 8 << 20, 1 | 2 | 4)  # wait for this window's writeback
                if case == "pwrite + drop-behind":
                    os.posix_fadvise(fd, done, 8 << 20, os.POSIX_FADV_DONTNEED)
                done += 8 << 20
    os.fsync(fd)
    os.close(fd)


def write_file(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        for _ in range(0, size, ROUND):
            f.write(os.urandom(ROUND))
        f.flush()
        os.fsync(f.fileno())


def run_one(case: str, work: Path, size: int) -> dict[str, float]:
    from memory_probes import reported_kib, settle

    target = work / "w.bin"
    freed = work / "freed.bin"
    if case == "copy_file_range, fresh pages" and not (work / "source.bin").exists():
        write_file(work / "source.bin", size)  # cached, and kept for every round
    settle()
    if case == "pwrite, reused pages":  # a cached file of the same size, deleted right before
        write_file(freed, size)
    cmd = [sys.executable, __file__, "--child", case, str(target), str(size)]
    perf = shutil.which("perf")
    out = work / "perf.txt"
    if perf:
        events = [a for e in EVENTS for a in ("-e", e)]
        cmd = [perf, "stat", "-x,", "-o", str(out), *events, "-e", EVENTS[-1], "--filter", LARGE, "--", *cmd]
    k0 = reported_kib()
    if case == "pwrite, reused pages":
        freed.unlink()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"failed: {case}")
    k1 = reported_kib()
    got = {"wall": wall, "user": usage.ru_utime, "sys": usage.ru_stime, "reported MiB": (k1 - k0) / 1024}
    if perf and out.exists():
        for line in out.read_text().splitlines():
            parts = line.split(",")
            if len(parts) > 2 and parts[2] in EVENTS:
                name = parts[2].split(":")[1]
                name = "folios >= 64 KiB" if name in got else name  # the filtered count comes second
                got[name] = float(parts[0]) if parts[0].isdigit() else float("nan")
    target.unlink()
    subprocess.run(["sync"], check=True)
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--cases", default=";".join(CASES), help="a subset, separated by semicolons")
    a = ap.parse_args()
    size = a.mib << 20
    cases = [c for c in CASES if c in a.cases.split(";")]
    work = Path(tempfile.mkdtemp(prefix="bench-write-paths-", dir=a.dir))
    found: dict[str, list[dict[str, float]]] = {c: [] for c in cases}
    loads = []
    try:
        for r in range(a.repeat):
            for case in cases if r % 2 == 0 else cases[::-1]:
                found[case].append(run_one(case, work, size))
                loads.append(os.getloadavg()[0])
                g = found[case][-1]
                print(f"round {r + 1} {case:32s} wall {g['wall']:.2f} s  sys {g['sys']:.2f} s", flush=True)
    finally:
        shutil.rmtree(work)
    keys = [k for k in found[cases[0]][0] if k not in ("wall", "user", "sys")]
    base = statistics.median(g["wall"] for g in found[cases[0]])
    print(
        f"\n{a.mib} MiB each, {a.repeat} interleaved rounds, {os.cpu_count()} cores, "
        f"load average {min(loads):.1f}-{max(loads):.1f}\n"
    )
    print(
        "| case | wall s, median (min-max) | vs first | CPU s (user + sys) | sys s | "
        + " | ".join(keys)
        + " |"
    )
    print("|---" * (5 + len(keys)) + "|")
    for case, gs in found.items():
        w = [g["wall"] for g in gs]
        cpu = statistics.median(g["user"] + g["sys"] for g in gs)
        sys_s = statistics.median(g["sys"] for g in gs)
        extra = " | ".join(f"{statistics.median(g.get(k, float('nan')) for g in gs):.0f}" for k in keys)
        print(
            f"| {case} | {statistics.median(w):.2f} ({min(w):.2f}-{max(w):.2f}) | "
            f"{statistics.median(w) / base:.2f}x | {cpu:.2f} | {sys_s:.2f} | {extra} |"
        )


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        write_case(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        main()
