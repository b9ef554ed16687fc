"""The ROOT lock: one daemon per ROOT, held by flock; the pid in the lock file only names the holder.

A disk too full for the pid is a warning and the lock still holds; a lock file that cannot be created is a
named, retryable LockFileError.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Iterator

import pytest

from stagerd.daemon.lock import LockFileError, RootLock, lock_path, read_holder, running_holder
from stagerd.errors import LockError
from tests.daemon.fullfs import fill


def test_root_lock_names_the_holder(tmp_path):
    with RootLock(tmp_path):
        assert running_holder(tmp_path) == os.getpid()
        with pytest.raises(LockError, match=f"pid {os.getpid()}"):
            RootLock(tmp_path).acquire()
    RootLock(tmp_path).acquire()  # released: free again


def test_root_lock_holder_is_found_without_the_pid_file(tmp_path):
    """The pid in the lock file is informative: with it missing (a full disk refused it), the kernel's lock
    table still names the holder, for `stagerd status` and for the second daemon's error."""
    with RootLock(tmp_path):
        lock_path(tmp_path).write_bytes(b"")
        assert read_holder(tmp_path) is None
        assert running_holder(tmp_path) == os.getpid()
        with pytest.raises(LockError, match=f"pid {os.getpid()}"):
            RootLock(tmp_path).acquire()
    assert running_holder(tmp_path) is None


@pytest.fixture
def stagerd_log(caplog) -> Iterator[pytest.LogCaptureFixture]:
    """caplog on the `stagerd` logger, which stops propagating once the CLI has set up logging."""
    logger = logging.getLogger("stagerd")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.WARNING, logger="stagerd")
    yield caplog
    logger.removeHandler(caplog.handler)


def test_the_lock_holds_when_a_full_disk_refuses_its_pid(tmpfs, stagerd_log):
    fs = tmpfs(1 << 20)
    lock_path(fs).parent.mkdir()
    filler = fill(fs)

    lock = RootLock(fs)
    lock.acquire()  # no page for the pid: a warning, not an OSError
    try:
        assert "cannot write this daemon's pid" in stagerd_log.text
        assert "No space left on device" in stagerd_log.text
        assert lock_path(fs).read_bytes() == b""
        # The flock is the lock: a second daemon is refused, and the kernel still names the holder.
        with pytest.raises(LockError, match=f"pid {os.getpid()}"):
            RootLock(fs).acquire()
        assert running_holder(fs) == os.getpid()
    finally:
        lock.release()
    with RootLock(fs):  # released: free again
        pass

    # A lock file a killed daemon left holding its pid is overwritten in place: no new page is needed.
    filler.unlink()
    lock_path(fs).write_text("4194303\n")
    fill(fs)
    stagerd_log.clear()
    with RootLock(fs):
        assert read_holder(fs) == os.getpid()
    assert "cannot write" not in stagerd_log.text


def test_a_lock_file_that_cannot_be_created_is_a_named_retryable_error(tmpfs):
    fs = tmpfs(1 << 20, inodes=4)
    fillers = []
    with pytest.raises(OSError) as info:
        while True:
            fillers.append(fs / f"filler-{len(fillers)}")
            fillers[-1].touch()
    assert info.value.errno == errno.ENOSPC  # no inode left for ROOT/.stagerd
    with pytest.raises(LockFileError) as err:
        RootLock(fs).acquire()
    assert err.value.retryable and "No space left on device" in str(err.value), str(err.value)
    assert "free space and inodes" in err.value.hint


def test_a_lock_file_that_is_a_link_is_refused_and_its_target_untouched(tmp_path):
    """`ROOT/.stagerd/lock` linked to a file elsewhere: the daemon truncated the target to its pid, and to
    nothing at exit."""
    from stagerd.errors import SymlinkError

    victim = tmp_path / "notes.txt"
    victim.write_bytes(b"someone's notes\n" * 100)
    root = tmp_path / "root"
    lock_path(root).parent.mkdir(parents=True)
    lock_path(root).symlink_to(victim)
    with pytest.raises(SymlinkError, match="symbolic link") as err:
        RootLock(root).acquire()
    assert str(lock_path(root)) in str(err.value) and err.value.hint
    assert victim.read_bytes() == b"someone's notes\n" * 100


def test_a_lock_file_pid_of_another_namespace_or_no_stagerd_is_not_named(tmp_path):
    """The file's pid is believed only in its own pid namespace; an older stagerd's bare pid only while it
    is a stagerd here. Otherwise the kernel names the holder: before, a pid of the next container (its
    pid 1) named this namespace's init as the daemon."""
    with RootLock(tmp_path):
        assert lock_path(tmp_path).read_text().split()[2] == "watch"
        for text in ("1 1 watch\n", f"{os.getppid()}\n"):  # another namespace's; a bare pid of no stagerd
            lock_path(tmp_path).write_text(text)
            assert read_holder(tmp_path) is None, text
            assert running_holder(tmp_path) == os.getpid(), text
