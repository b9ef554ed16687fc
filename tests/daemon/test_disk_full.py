"""Disk full during export, on filesystems that really run out.

- A size-limited tmpfs mounted for the test (needs CAP_SYS_ADMIN; the tests that need it are skipped with
  the reason where mounting is refused): the staging root itself fills up, at every point of the export in
  turn, by bytes and by inodes; `stagerd consolidate` into a full OUT; `stagerd watch --once` on a full ROOT.
- RLIMIT_FSIZE in a child process, which works unprivileged: the kernel refuses writes past the limit with
  EFBIG.

Every case must end the same way: an OutputError with a message (exit 3, retryable), no `export/`, no
`export.tmp/`, no OUT, and the staged step byte for byte as it was, still committed.

The journal's own disk filling up (ROOT/.stagerd on a full tmpfs) must end in a JournalFullError that names
the journal file and says the disk is full, with nothing recorded, nothing lost, and the work resumed once
space is freed; a real I/O error (EFBIG) must not be called a full disk.

A long-running `stagerd watch` whose journal disk fills while steps are in flight or waiting must not spin:
one log line per backoff period, CPU near idle, /healthz 503 naming the journal; once space is back it goes
on by itself and publishes every step exactly once.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from stagerd.contract import layout
from stagerd.daemon.journal import Journal, journal_path
from stagerd.engine.export import export_step
from stagerd.engine.verify import verify_export
from stagerd.errors import JournalError, JournalFullError, OutputError
from tests.daemon.fullfs import PAGE, fill, remount, usage
from tests.daemon_helpers import (
    WatchProc,
    child_env,
    fast_flags,
    free_port,
    is_state,
    manifests,
    stage_copy,
    start_watch,
)

REPO = Path(__file__).resolve().parents[2]


def snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def assert_clean_failure(step: Path, before: dict[str, bytes], err: OutputError) -> None:
    assert err.retryable and err.path
    assert "no space left" in str(err) or "No space left" in str(err), str(err)
    assert not (step / layout.EXPORT_DIR).exists()
    assert not (step / layout.EXPORT_TMP_DIR).exists()
    assert snapshot(step) == before  # nothing deleted, nothing changed, nothing left behind
    assert layout.is_committed(step)


# A small max_shard_size gives several output files, so the space runs out at each of them in turn.
SHARD = 2048


def test_staging_fs_filling_up_at_every_point_of_the_export(step_dir, tmpfs):
    probe = tmpfs(64 << 20)
    step = probe / step_dir.name
    shutil.copytree(step_dir, step)
    base_pages, _ = usage(probe)
    export_step(step, max_shard_size=SHARD)
    need_pages = usage(probe)[0] - base_pages
    files = len(list((step / layout.EXPORT_DIR).rglob("*")))
    assert files >= 5 and need_pages >= files  # several shards, the index and the extras

    outcomes = []
    for extra in range(need_pages + 1):
        fs = tmpfs((base_pages + extra) * PAGE)
        step = fs / step_dir.name
        shutil.copytree(step_dir, step)
        assert usage(fs)[0] == base_pages
        before = snapshot(step)
        try:
            export_step(step, max_shard_size=SHARD)
        except OutputError as e:
            assert_clean_failure(step, before, e)
            outcomes.append("failed")
            continue
        assert verify_export(step / layout.EXPORT_DIR, step).files >= 1
        outcomes.append("exported")
    # Every size short of the need fails cleanly; the exact need succeeds.
    assert outcomes == ["failed"] * need_pages + ["exported"]


def test_running_out_of_inodes_is_the_same_clean_failure(step_dir, tmpfs):
    probe = tmpfs(64 << 20, inodes=10_000)
    step = probe / step_dir.name
    shutil.copytree(step_dir, step)
    _, base = usage(probe)
    export_step(step, max_shard_size=SHARD)
    need = usage(probe)[1] - base

    for extra in range(need):
        fs = tmpfs(64 << 20, inodes=base + extra)
        step = fs / step_dir.name
        shutil.copytree(step_dir, step)
        before = snapshot(step)
        with pytest.raises(OutputError) as info:
            export_step(step, max_shard_size=SHARD)
        assert_clean_failure(step, before, info.value)


def test_a_failed_export_succeeds_once_space_is_freed(step_dir, tmpfs):
    probe = tmpfs(64 << 20)
    shutil.copytree(step_dir, probe / "s")
    base = usage(probe)[0]
    fs = tmpfs((base + 1) * PAGE)
    step = fs / step_dir.name
    shutil.copytree(step_dir, step)
    before = snapshot(step)

    with pytest.raises(OutputError) as info:
        export_step(step)
    assert_clean_failure(step, before, info.value)

    remount(fs, "size=64m")
    result = export_step(step)
    assert not result.skipped
    assert verify_export(step / layout.EXPORT_DIR, step).tensors == result.tensors


def _cli(*args: str, preexec: Callable[[], None] | None = None, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stagerd.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=preexec,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
    )


def assert_cli_output_error(r: subprocess.CompletedProcess, words: str) -> None:
    assert r.returncode == 3, r.stderr  # retryable
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("stagerd:")]
    assert len(lines) == 1 and "OutputError" in lines[0] and words in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_consolidate_into_a_full_out(step_dir, tmpfs):
    fs = tmpfs(2 * PAGE)
    before = snapshot(step_dir)

    r = _cli("consolidate", str(step_dir), str(fs / "out"))

    assert_cli_output_error(r, "no space left")
    assert list(fs.iterdir()) == []  # neither OUT nor its temp sibling
    assert snapshot(step_dir) == before


def _limit_file_size(limit: int) -> Callable[[], None]:
    def apply() -> None:
        import resource
        import signal

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def test_a_file_size_limit_is_a_clean_output_error(step_dir, tmp_path):
    """Unprivileged: RLIMIT_FSIZE makes the kernel refuse the write (EFBIG) past `limit` bytes."""
    before = snapshot(step_dir)
    out = tmp_path / "out"

    r = _cli("consolidate", str(step_dir), str(out), preexec=_limit_file_size(4096))

    assert_cli_output_error(r, "File too large")
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == [step_dir.name]
    assert snapshot(step_dir) == before

    ok = _cli("consolidate", str(step_dir), str(out), preexec=_limit_file_size(1 << 30))
    assert ok.returncode == 0, ok.stderr


def full_root(step_dir: Path, tmpfs: Callable[..., Path], state: Path) -> Path:
    """A ROOT on a tmpfs one page larger than the staged step: the export cannot fit.

    The daemon's journal lives in ROOT/.stagerd; here that is a link to a roomy directory, so that what runs
    out is the export, not the journal (the journal's own disk filling up has its cases below)."""
    probe = tmpfs(64 << 20)
    shutil.copytree(step_dir, probe / step_dir.name)
    root = tmpfs((usage(probe)[0] + 1) * PAGE)
    state.mkdir()
    (root / layout.STATE_DIR).symlink_to(state, target_is_directory=True)
    shutil.copytree(step_dir, root / step_dir.name)
    return root


WATCH_FLAGS = ["--once", "--nice", "0", "--io-class", "none", "--metrics-port", "0"]


def test_watch_once_on_a_full_root_records_a_failed_step(step_dir, tmpfs, tmp_path):
    root = full_root(step_dir, tmpfs, tmp_path / "state")
    step = root / step_dir.name
    before = snapshot(step)
    sink = tmp_path / "published"

    r = _cli("watch", str(root), "--sink", sink.as_uri(), *WATCH_FLAGS, "--max-attempts", "1")

    assert r.returncode != 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert "step 100" in r.stdout and "no space left" in r.stdout, r.stdout
    assert snapshot(step) == before
    assert not (step / layout.EXPORT_DIR).exists() and not (step / layout.EXPORT_TMP_DIR).exists()
    assert not sink.exists() or not any(sink.rglob("*.safetensors"))
    status = _cli("status", str(root), "--json")
    assert status.returncode == 0, status.stderr
    (s,) = json.loads(status.stdout)["steps"]
    assert s["step"] == 100 and s["state"] == "quarantined"
    assert s["error_class"] == "OutputError" and "no space left" in s["error_message"]


def test_watch_retries_the_export_once_space_is_freed(step_dir, tmpfs, tmp_path):
    root = full_root(step_dir, tmpfs, tmp_path / "state")
    sink = tmp_path / "published"
    cmd = [sys.executable, "-m", "stagerd.cli", "watch", str(root), "--sink", sink.as_uri(), *WATCH_FLAGS]
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "STAGERD_RETRY_BASE_SECONDS": "1",
        "STAGERD_MAX_ATTEMPTS": "3",
    }
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # JSON lines: wait for the first failed attempt
            rec = json.loads(line) if line.startswith("{") else {}
            if rec.get("step") == 100 and rec.get("state") == "failed":
                assert rec["error_class"] == "OutputError"
                break
        else:
            pytest.fail("the daemon exited without a failed attempt")
        remount(root, "size=64m")
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and "1 step(s) published, 0 not" in out, out
    assert verify_export(root / step_dir.name / layout.EXPORT_DIR, root / step_dir.name).files >= 1
    assert len(list(sink.rglob(layout.MANIFEST_NAME))) == 1


# -- the journal's own filesystem fills up ------------------------------------------------------------------


def journal_snapshot(j: Journal) -> tuple:
    return j.steps(), j.lanes(), j.events(), j.meta()


def assert_names_the_full_journal(err: JournalError, path: Path) -> None:
    assert isinstance(err, JournalFullError) and err.retryable, repr(err)
    assert err.path == str(path) and "the disk is full" in str(err), str(err)
    assert "free space" in err.hint


A, B = "file:///a", "file:///b"


def transitions(j: Journal) -> dict[str, Callable[[], object]]:
    """One of every kind of journal write the daemon makes, each valid in the state `journal_in_every_state`
    leaves."""
    return {
        "add_step": lambda: j.add_step(9, "/r/9", 9.0),
        "begin_export": lambda: j.begin_export(1),
        "finish_export": lambda: j.finish_export(
            2, [A, B], seconds=1, export_bytes=1, tensor_bytes=1, files=1, skipped=False
        ),
        "fail_export": lambda: j.fail_export(2, "OutputError", "ENOSPC", next_try=1.0, quarantine=False),
        "begin_publish": lambda: j.begin_publish(3, B),
        "finish_publish": lambda: j.finish_publish(
            3, A, sinks=[A, B], seconds=1, bytes_total=1, bytes_uploaded=1, location="x", skipped=False
        ),
        "fail_publish": lambda: j.fail_publish(3, A, "SinkError", "503", next_try=1.0, quarantine=False),
        "retire": lambda: j.retire(4, "retention"),
        "reexport": lambda: j.reexport(4, "export/ disappeared"),
        "quarantine_step": lambda: j.quarantine_step(1, "MissingStep", "gone"),
        "ensure_lanes": lambda: j.ensure_lanes([A, B, "file:///c"]),
        "recover": j.recover,
        "abandon": lambda: j.abandon(2, None, "abandoned at shutdown"),
        "set_meta": lambda: j.set_meta(pid=1),
    }


def journal_in_every_state(root: Path) -> Journal:
    """Step 1 committed, 2 exporting, 3 exported with lane A publishing, 4 published."""
    j = Journal.open(root)
    for step in (1, 2, 3, 4):
        j.add_step(step, f"/r/{step}", float(step))
    for step in (2, 3, 4):
        j.begin_export(step)
    for step in (3, 4):
        j.finish_export(step, [A, B], seconds=1, export_bytes=1, tensor_bytes=1, files=1, skipped=False)
    for sink in (A, B):
        j.begin_publish(4, sink)
        j.finish_publish(
            4, sink, sinks=[A, B], seconds=1, bytes_total=1, bytes_uploaded=1, location="x", skipped=False
        )
    j.begin_publish(3, A)
    return j


def test_every_journal_write_on_a_full_disk_is_refused_by_name_and_records_nothing(tmpfs):
    fs = tmpfs(4 << 20)
    j = journal_in_every_state(fs)
    try:
        before = journal_snapshot(j)
        filler = fill(fs)
        for name, write in transitions(j).items():
            with pytest.raises(JournalFullError) as info:
                write()
            assert_names_the_full_journal(info.value, j.path)
            assert journal_snapshot(j) == before, name  # all or nothing: not one row changed

        filler.unlink()  # space freed: the next transitions go on from where the journal stood
        writes = transitions(j)
        for name in ("add_step", "begin_export", "finish_export", "finish_publish", "retire", "ensure_lanes"):
            writes[name]()
        assert [r.state for r in j.steps()] == ["exporting", "exported", "exported", "retired", "committed"]
        assert [ln.state for ln in j.lanes(3)] == ["published", "pending", "pending"]
    finally:
        j.close()
    conn = sqlite3.connect(journal_path(fs))
    assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    conn.close()


def test_opening_the_journal_on_a_full_disk_names_it(tmpfs):
    fs = tmpfs(4 << 20)
    journal_in_every_state(fs).close()
    filler = fill(fs)
    # An existing journal: SQLite cannot make its -shm index and says "disk I/O error".
    for open_ in (Journal.open, Journal.open_readonly):
        with pytest.raises(JournalFullError) as info:
            open_(fs)
        assert_names_the_full_journal(info.value, journal_path(fs))
        assert "disk I/O error" in str(info.value)
    filler.unlink()
    j = Journal.open(fs)
    assert [r.state for r in j.steps()] == ["committed", "exporting", "exported", "published"]
    j.close()


def test_a_journal_first_created_on_a_full_disk_leaves_no_half_made_file(tmpfs):
    fs = tmpfs(1 << 20)
    filler = fill(fs)
    with pytest.raises(JournalFullError) as info:
        Journal.open(fs)
    assert_names_the_full_journal(info.value, journal_path(fs))
    assert list((fs / layout.STATE_DIR).iterdir()) == []
    with pytest.raises(JournalError, match="has not run on this ROOT"):
        Journal.open_readonly(fs)  # not "journal schema 0"
    filler.unlink()
    j = Journal.open(fs)
    assert j.add_step(1, "/r/1", 1.0)
    j.close()


def test_a_journal_out_of_inodes_is_named_too(tmpfs):
    fs = tmpfs(4 << 20, inodes=64)
    Journal.open(fs).close()  # a clean close removes the -wal and -shm files: reopening needs 2 inodes
    fillers = []
    with pytest.raises(OSError) as info:
        while True:
            fillers.append(fs / f"filler-{len(fillers)}")
            fillers[-1].touch()
    assert info.value.errno == errno.ENOSPC
    with pytest.raises(JournalFullError) as full:
        Journal.open(fs)
    assert_names_the_full_journal(full.value, journal_path(fs))
    assert "no free inodes" in str(full.value)
    for f in fillers[:-1]:
        f.unlink()
    Journal.open(fs).close()


def _write_journal_under_a_file_size_limit(root: str) -> None:
    """Child process: open a journal, then let RLIMIT_FSIZE (EFBIG, not ENOSPC) stop its next writes."""
    import resource
    import signal

    j = Journal.open(root)
    j.add_step(1, "/r/1", 1.0)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    size = sum(p.stat().st_size for p in j.path.parent.iterdir())
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    for step in range(2, 1000):
        try:
            j.add_step(step, "/r/" + "x" * 1000, 1.0)
        except JournalError as e:
            print(f"{type(e).__name__}: {e}")
            return
    print("no error")


def test_a_real_io_error_is_not_called_a_full_disk(tmp_path):
    helper = "tests.daemon.test_disk_full import _write_journal_under_a_file_size_limit"
    code = f"from {helper} as w; w({str(tmp_path)!r})"
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("JournalError: ") and "disk I/O error" in r.stdout, r.stdout
    assert "disk is full" not in r.stdout


def journal_on_tmpfs(root: Path, tmpfs: Callable[..., Path]) -> Path:
    """ROOT/.stagerd as a link into a small tmpfs: what fills up is the journal's disk, not ROOT."""
    fs = tmpfs(1 << 20)
    (root / layout.STATE_DIR).symlink_to(fs, target_is_directory=True)
    return fs


def _watch_once(root: Path, sink: Path) -> subprocess.CompletedProcess:
    return _cli("watch", str(root), "--sink", sink.as_uri(), *WATCH_FLAGS)


def assert_resumes_and_publishes(root: Path, step: Path, sink: Path) -> None:
    r = _watch_once(root, sink)
    assert r.returncode == 0 and "1 step(s) published, 0 not" in r.stdout, r.stdout + r.stderr
    assert verify_export(step / layout.EXPORT_DIR, step).files >= 1
    assert len(list(sink.rglob(layout.MANIFEST_NAME))) == 1
    conn = sqlite3.connect(journal_path(root))
    assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    conn.close()


@pytest.mark.parametrize("pages_left", [1, 0], ids=["pid-fits", "disk-completely-full"])
@pytest.mark.parametrize("journal", ["existing", "new"])
def test_watch_on_a_full_journal_disk_names_it_then_resumes_once_space_is_freed(
    step_dir, tmpfs, tmp_path, journal, pages_left
):
    root = tmp_path / "root"
    root.mkdir()
    fs = journal_on_tmpfs(root, tmpfs)
    sink = tmp_path / "published"
    if journal == "existing":
        assert _watch_once(root, sink).returncode == 0  # nothing staged yet: creates the journal
    step = root / step_dir.name
    shutil.copytree(step_dir, step)
    before = snapshot(step)
    # One page left, which the ROOT lock's pid takes, or none at all; the journal gets nothing either way.
    filler = fill(fs, leave_pages=pages_left)

    r = _watch_once(root, sink)

    assert r.returncode == 3, r.stdout + r.stderr  # retryable
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("stagerd:")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"JournalFullError: {journal_path(root)}: the disk is full" in lines[0], lines[0]
    assert "free space" in r.stderr
    # A clean stop empties the lock file, so with no page left its pid cannot be written: a warning only.
    assert ("cannot write this daemon's pid" in r.stderr) == (pages_left == 0), r.stderr
    status = _cli("status", str(root))
    if journal == "existing":
        assert status.returncode == 3 and "the disk is full" in status.stderr, status.stderr
    else:
        assert "has not run on this ROOT" in status.stderr, status.stderr  # not "journal schema 0"
    assert snapshot(step) == before and not (step / layout.EXPORT_DIR).exists()
    assert not sink.exists() or not any(sink.rglob("*.safetensors"))

    filler.unlink()
    assert_resumes_and_publishes(root, step, sink)


def test_journal_disk_filling_mid_export_loses_nothing_and_the_next_start_resumes(step_dir, tmpfs, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    fs = journal_on_tmpfs(root, tmpfs)
    step = root / step_dir.name
    shutil.copytree(step_dir, step)
    before = snapshot(step)
    sink = tmp_path / "published"
    cmd = [sys.executable, "-m", "stagerd.cli", "watch", str(root), "--sink", sink.as_uri(), *WATCH_FLAGS]
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "STAGERD_TEST_PAUSE_AT": "export",
        "STAGERD_TEST_PAUSE_SECONDS": "2",
    }
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # the export is under way: fill the journal's disk now
            if "test pause at export" in line:
                break
        else:
            pytest.fail("the daemon exited before exporting")
        filler = fill(fs)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    # The export finished but could not be recorded: --once stops as a full journal at start does (exit 3,
    # naming the journal, no traceback) and the step is left as the journal last had it.
    assert proc.returncode == 3, out + err
    lines = [ln for ln in err.splitlines() if ln.startswith("stagerd:")]
    assert len(lines) == 1 and f"JournalFullError: {journal_path(root)}: the disk is full" in lines[0], err
    assert "Traceback" not in err and "never retrieved" not in err, err
    staged = {k: v for k, v in snapshot(step).items() if not k.startswith(f"{layout.EXPORT_DIR}/")}
    assert staged == before
    assert not sink.exists() or not any(sink.rglob("*.safetensors"))

    filler.unlink()
    assert_resumes_and_publishes(root, step, sink)
    j = Journal.open_readonly(root)
    trail = [(e.from_state, e.to_state, e.message) for e in j.events(100) if e.sink is None]
    j.close()
    assert trail[:4] == [
        (None, "committed", None),
        ("committed", "exporting", None),
        ("exporting", "committed", "recovered after a crash"),
        ("committed", "exporting", None),
    ]


# -- the journal's disk filling up under a running daemon -------------------------------------------------

# Short backoffs, so a test sees several of them and the daemon resumes quickly once space is back.
BACKOFF = {"STAGERD_RETRY_BASE_SECONDS": "0.5", "STAGERD_RETRY_MAX_SECONDS": "2"}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (fields 14 and 15 of /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def healthz(port: int) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def journal_failures_counted(port: int) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    key = 'stagerd_failures_total{error_class="JournalFullError",stage="journal"} '
    return sum(float(ln[len(key) :]) for ln in body.splitlines() if ln.startswith(key))


def is_journal_error(r: dict) -> bool:
    return r.get("level") == "error" and r.get("msg", "").startswith("journal: cannot")


async def assert_quiet_while_the_journal_is_full(w: WatchProc, port: int, seconds: float = 3.0) -> None:
    """Over `seconds`: a bounded number of log lines, CPU near idle, /healthz unhealthy naming the journal."""
    (first,) = [r for r in w.records() if is_journal_error(r)][:1]
    assert "JournalFullError" in first["msg"] and "the disk is full" in first["msg"], first
    assert first["hint"] == JournalFullError.hint and "free space" in first["msg"], first
    lines, cpu, t0 = len(w.text().splitlines()), cpu_seconds(w.pid), time.monotonic()
    await asyncio.sleep(seconds)
    wall, cpu = time.monotonic() - t0, cpu_seconds(w.pid) - cpu
    new = w.text().splitlines()[lines:]
    assert len(new) < 50, "\n".join(new[:60])
    assert sum('"journal: cannot' in ln for ln in new) <= 4, "\n".join(new)  # one per backoff period
    assert cpu < 0.2 * wall, f"{cpu:.2f}s of CPU in {wall:.2f}s"
    status, body = healthz(port)
    assert status == 503 and body["status"] == "journal unavailable", body
    assert body["journal_error"].startswith("JournalFullError: "), body
    assert journal_failures_counted(port) >= 1
    assert w.proc.returncode is None  # still running: it waits for space, it does not exit


def assert_each_step_published_once(root: Path, sink: Path, steps: list[int], exports: int = 1) -> None:
    """Every step exported `exports` time(s) and published exactly once, never redone, bytes verified."""
    assert sorted(manifests(sink)) == steps
    j = Journal.open_readonly(root)
    try:
        assert [(r.step, r.state, r.export_skipped) for r in j.steps()] == [
            (s, "published", 0) for s in steps
        ]
        assert all(ln.state == "published" and ln.skipped == 0 for ln in j.lanes()), j.lanes()
        for s in steps:
            moves = [(e.sink is None, e.to_state) for e in j.events(s)]
            assert moves.count((True, "exporting")) == exports, moves
            assert moves.count((False, "publishing")) == moves.count((False, "published")) == 1, moves
    finally:
        j.close()
    for s in steps:
        step = root / layout.step_dir_name(s)
        export = step / layout.EXPORT_DIR
        assert verify_export(export, step).files >= 1
        for f in (p for p in export.rglob("*") if p.is_file()):
            assert (sink / step.name / f.relative_to(export)).read_bytes() == f.read_bytes(), f


async def stop(w: WatchProc) -> None:
    if w.proc.returncode is None:
        w.kill(signal.SIGTERM)
        assert await w.wait(30) == 0, w.text()[-4000:]


async def wait_until(cond: Callable[[], bool], w: WatchProc, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline and w.proc.returncode is None, w.text()[-4000:]
        await asyncio.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["export", "publish"])
async def test_a_running_daemon_waits_out_a_full_journal_disk_then_publishes_every_step_once(
    tmpfs, tmp_path, dcp_mixed, where
):
    src, _ = dcp_mixed
    root, sink = tmp_path / "root", tmp_path / "sink"
    root.mkdir()
    fs = tmpfs(8 << 20)
    (root / layout.STATE_DIR).symlink_to(fs, target_is_directory=True)
    for step in (1, 2):
        stage_copy(root, step, src, 4)
    port = free_port()
    env = child_env(STAGERD_TEST_PAUSE_AT=where, STAGERD_TEST_PAUSE_SECONDS="2", **BACKOFF)
    w = await start_watch(
        root, "--sink", sink.as_uri(), *fast_flags(metrics_port=port), log_dir=tmp_path / "log", env=env
    )
    try:
        await w.wait_for(lambda r: r.get("test_pause") == where and r.get("step") == 1)
        filler = fill(fs)  # step 1's work is under way and step 2 waits: neither can be recorded now
        stage_copy(root, 3, src, 4)  # found by the watcher, but the journal cannot take it either
        done = root / layout.step_dir_name(1) / layout.EXPORT_DIR / layout.INDEX_NAME
        if where == "publish":
            done = sink / layout.step_dir_name(1) / layout.MANIFEST_NAME
        await wait_until(done.exists, w)  # the work finished; recording it is what waits
        await w.wait_for(is_journal_error)

        await assert_quiet_while_the_journal_is_full(w, port)

        filler.unlink()  # space is back: no restart, the daemon carries on by itself
        for step in (1, 2, 3):
            await w.wait_for(is_state(step, "published"), timeout=60)
        status, body = healthz(port)
        assert status == 200 and body["status"] == "ok" and "journal_error" not in body, body
        await stop(w)
    finally:
        if w.proc.returncode is None:
            w.kill()
            await w.wait()
    text = w.text()
    assert "journal: writable again" in text
    assert "Traceback" not in text and "never retrieved" not in text, text[-4000:]
    assert "filesystem events unavailable" not in text  # a journal error is not a watch failure
    assert_each_step_published_once(root, sink, [1, 2, 3])


@pytest.mark.slow
async def test_a_retry_that_cannot_begin_on_a_full_journal_disk_backs_off(step_dir, tmpfs, tmp_path):
    state = tmpfs(8 << 20) / "state"
    root = full_root(step_dir, tmpfs, state)  # the export fails for want of space on ROOT, then is retried
    sink = tmp_path / "published"
    port = free_port()
    w = await start_watch(
        root,
        "--sink",
        sink.as_uri(),
        *fast_flags(metrics_port=port),
        log_dir=tmp_path / "log",
        env=child_env(**{**BACKOFF, "STAGERD_RETRY_BASE_SECONDS": "1", "STAGERD_MAX_ATTEMPTS": "20"}),
    )
    try:
        await w.wait_for(is_state(100, "failed"))
        filler = fill(state.parent)  # before the retry is due: beginning it cannot be recorded
        await w.wait_for(lambda r: is_journal_error(r) and "start the export of step 100" in r["msg"])

        await assert_quiet_while_the_journal_is_full(w, port)

        filler.unlink()
        remount(root, "size=64m")
        await w.wait_for(is_state(100, "published"), timeout=60)
        await stop(w)
    finally:
        if w.proc.returncode is None:
            w.kill()
            await w.wait()
    assert "Traceback" not in w.text() and "never retrieved" not in w.text()
    # The failed attempt and the one that worked; the refused beginnings recorded nothing.
    assert_each_step_published_once(root, sink, [100], exports=2)
