"""The journal's own disk filling up (ROOT/.stagerd on a full tmpfs).

It must end in a JournalFullError that names the journal file and says the disk is full, with nothing
recorded, nothing lost, and the work resumed once space is freed; a real I/O error (EFBIG) must not be
called a full disk.
"""

from __future__ import annotations

import errno
import shutil
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from stagerd.contract import layout
from stagerd.daemon.journal import Journal, journal_path
from stagerd.engine.verify import verify_export
from stagerd.errors import JournalError, JournalFullError
from tests.cli_helpers import REPO, clean_env, run_cli, start_cli
from tests.daemon.fullfs import WATCH_FLAGS, fill, snapshot

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
    helper = "tests.daemon.journal.test_disk_full import _write_journal_under_a_file_size_limit"
    code = f"from {helper} as w; w({str(tmp_path)!r})"
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env=clean_env(),
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
    return run_cli(["watch", root, "--sink", sink.as_uri(), *WATCH_FLAGS])


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
    status = run_cli(["status", root])
    if journal == "existing":  # read where SQLite's shared-memory file is still there, else named
        read = status.returncode == 0 and "no steps yet" in status.stdout
        assert read or (status.returncode == 3 and "the disk is full" in status.stderr), status.stderr
    else:
        # not "journal schema 0", nor that no watch ran: one did, and could not create its journal
        assert "no journal yet: " in status.stderr and "has not run" not in status.stderr, status.stderr
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
    env = {"STAGERD_TEST_PAUSE_AT": "export", "STAGERD_TEST_PAUSE_SECONDS": "2"}
    proc = start_cli(["watch", root, "--sink", sink.as_uri(), *WATCH_FLAGS], env=env)
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
    made = (f"{layout.EXPORT_DIR}/", layout.EXPORT_OPTIONS_NAME)  # what the finished export wrote
    staged = {k: v for k, v in snapshot(step).items() if not k.startswith(made)}
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
