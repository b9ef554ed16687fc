"""One rank's save fails before, during or after its write: every rank fails it alike and none hangs."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import time
from pathlib import Path

import pytest
import torch

from stagerd.contract import commit_marker, layout
from tests.gloo import join, launch
from tests.training.gloo_run import (
    WORLD,
    attempt,
    attempt_result,
    dtensors,
    record,
    slow_tensor,
)

BIG_NUMEL = 24 << 20  # 96 MiB of fp32: more than the address space a failing rank has left while staging


def _limit_address_space(margin: int) -> None:
    """Let this process map only `margin` more bytes: the next large host allocation fails (ENOMEM)."""
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + margin, resource.RLIM_INFINITY))


def _unlimit() -> None:
    for res in (resource.RLIMIT_AS, resource.RLIMIT_FSIZE):
        resource.setrlimit(res, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def _failures_run(rank: int, world: int, init_file: str, root: str, out: str) -> None:
    import torch.distributed as dist

    from stagerd import Stager
    from stagerd.errors import SaveError

    join(rank, world, init_file)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    root_p, rec = Path(root), {}
    try:
        sd = dtensors(world, rank)
        big = torch.ones(BIG_NUMEL)  # allocated now, while there is room
        with Stager(root, checkpointer="thread") as stager:
            # before the write: rank 1 cannot allocate its host staging buffer (model state)
            if rank == 1:
                _limit_address_space(32 << 20)
            rec["stage_r1"] = attempt(stager, {**sd, "big.rank1": big} if rank == 1 else sd, 11)
            _unlimit()
            # before the write: rank 0 cannot allocate its host staging buffer (optimizer state)
            optim = {f"m{rank}": big if rank == 0 else torch.zeros(4)}  # rank-local keys: no dedup
            if rank == 0:
                _limit_address_space(32 << 20)
            rec["stage_r0_optim"] = attempt(stager, sd, 12, optimizer_state=optim)
            _unlimit()
            # before the write, after the agreement: rank 0 cannot clear a stale step directory
            if rank == 0:
                (root_p / "step-00000013").mkdir()
                (root_p / "step-00000013" / "model").write_text("not a directory")
            rec["clear_r0"] = attempt(stager, sd, 13)
            if rank == 0:
                (root_p / "step-00000013" / "model").unlink()
            # during the write: the coordinator's shard hits the file size limit
            if rank == 0:
                resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.RLIM_INFINITY))
            rec["write_r0"] = attempt(stager, sd, 14)
            _unlimit()
            # after its model write: rank 1's optimizer shard hits the file size limit
            if rank == 1:
                resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, resource.RLIM_INFINITY))
            optim = {f"m{rank}": torch.ones(1 << 20) if rank == 1 else torch.zeros(4)}
            rec["optim_write_r1"] = attempt(stager, sd, 15, optimizer_state=optim)
            _unlimit()
            # after every shard was written: rank 0's extras hit the file size limit
            if rank == 0:
                resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, resource.RLIM_INFINITY))
            rec["extras_r0"] = attempt(stager, sd, 16, extras={"blob.bin": bytes(1 << 20)})
            _unlimit()
            # after everything was written: rank 0 cannot put the marker in place (a directory has its name)
            if rank == 0:
                (root_p / "step-00000018" / layout.MARKER_NAME).mkdir(parents=True)
                (root_p / "step-00000018" / layout.MARKER_NAME / "x").write_text("")
            rec["marker_r0"] = attempt(stager, sd, 18)
            rec["committed"] = {
                s: layout.is_committed(root_p / layout.step_dir_name(s)) for s in range(11, 19)
            }
            # every rank is still in step: the same steps save and commit now
            rec["retry"] = [stager.save(sd, s).result().step for s in (11, 13)]
            # a rank that dies while its write is in flight: the survivor's save fails, it does not hang
            handle = stager.save({**sd, "slow.rank1": slow_tensor()} if rank == 1 else sd, 17)
            if rank == 1:
                record(Path(out), rank, rec)
                os._exit(0)
            t0 = time.monotonic()
            rec["peer_died"] = attempt_result(handle)
            rec["peer_died_s"] = time.monotonic() - t0
            rec["peer_died_committed"] = layout.is_committed(root_p / layout.step_dir_name(17))
            with contextlib.suppress(SaveError):
                stager.wait()
        record(Path(out), rank, rec)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def failures(tmp_path_factory):
    root = tmp_path_factory.mktemp("fail-root")
    out = tmp_path_factory.mktemp("fail-out")
    launch(_failures_run, str(root), str(out))
    return root, [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize(
    ("case", "failing_rank", "cause"),
    [
        ("stage_r1", 1, "can't allocate memory"),
        ("stage_r0_optim", 0, "can't allocate memory"),
        ("clear_r0", 0, "NotADirectoryError"),
        ("write_r0", 0, "File too large"),
        ("optim_write_r1", 1, "writing optim/shard-00002-00001.safetensors failed: OSError: [Errno 27]"),
        ("extras_r0", 0, "File too large"),
        ("marker_r0", 0, "writing the commit marker failed: IsADirectoryError"),
    ],
)
def test_one_rank_failing_fails_the_save_on_every_rank(failures, case, failing_rank, cause):
    _root, recs = failures
    for rank, rec in enumerate(recs):
        got = rec[case]
        assert got["save"] is None, f"rank {rank}: save() itself raised: {got['save']}"
        assert got["handle"] is not None, f"rank {rank}: the handle of a failed save succeeded"
        assert "was not committed" in got["handle"] and cause in got["handle"], got["handle"]
        assert f"rank {failing_rank}" in got["handle"], got["handle"]
        assert got["wait"] == got["handle"]
        if case.startswith("stage_") and rank == failing_rank:
            assert got["staged"] is not None and cause in got["staged"]
        else:
            assert got["staged"] is None


def test_a_dead_rank_fails_the_save_on_the_survivor(failures):
    _root, recs = failures
    rec = recs[0]
    assert rec["peer_died"] is not None, "the survivor's save succeeded without its peer"
    assert "step 17 was not committed: lost contact with the other ranks" in rec["peer_died"]
    assert rec["peer_died_s"] < 30  # gloo notices the closed connection; no timeout was waited out
    assert rec["peer_died_committed"] is False


def test_failed_saves_leave_no_marker_and_the_ranks_stay_in_step(failures):
    root, recs = failures
    for rec in recs:
        assert rec["committed"] == {str(s): False for s in range(11, 19)}
        assert rec["retry"] == [11, 13]
    for s in (11, 13):
        commit_marker.check_staged_files(
            root / layout.step_dir_name(s), commit_marker.read_marker(root / layout.step_dir_name(s))
        )


def test_a_failed_write_never_writes_through_a_closed_descriptor(tmp_path):
    """One file's write fails while the other files' chunks are still queued: the writer closed every
    descriptor at once, and the queued chunks were then written through the closed numbers, which the
    process had meanwhile given to other files (here: the trainer's own), at the chunk's offset. The failure
    is made by a piece `os.pwrite` refuses (not contiguous); the same path runs on EIO or ENOSPC."""
    from stagerd.training.shard_files import FileJob, ShardWriter, WriteError

    paths = [tmp_path / f"victim-{i}" for i in range(201)]  # the trainer's own files (logs, data)
    for path in paths:
        path.write_bytes(b"v" * 1024)
    writer = ShardWriter(1)
    bad = FileJob("model/a.bin", [memoryview(bytearray(64))[::2]])
    good = [FileJob(f"model/b{i:03d}.bin", [memoryview(b"S" * 512)]) for i in range(200)]
    with pytest.raises(WriteError, match=r"model/a\.bin"):
        writer.write(tmp_path, [bad, *good])
    victims = [os.open(path, os.O_RDWR) for path in paths]  # opened by the trainer right after
    writer.close()
    for fd in victims:
        assert os.pread(fd, 1024, 0) == b"v" * 1024
        os.close(fd)


def test_a_save_that_fails_on_a_full_disk_gives_its_space_back(tmp_path):
    """The model file fits, the optimizer state does not: the save fails (no marker), and the files it did
    write used to stay, fallocated, in a step directory nothing ever removes (the daemon never touches an
    uncommitted step, and only a save of the same step clears it): the space stayed taken, and the next
    saves failed on it too."""
    import subprocess

    from stagerd import Stager
    from stagerd.errors import SaveError
    from tests.daemon.fullfs import mount

    fs = tmp_path / "fs"
    fs.mkdir()
    r = mount(fs, f"size={2 << 20}")
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()})")
    try:
        free = os.statvfs(fs).f_bavail
        model = {"w": torch.zeros(384 << 10)}  # 1.5 MiB, written first (the largest): fits
        optim = {"state": {0: {"exp_avg": torch.zeros(256 << 10)}}}  # 1 MiB more: does not fit
        with Stager(fs / "root") as stager:
            with pytest.raises(SaveError, match="No space left"):
                stager.save(model, 1, optimizer_state=optim).result()
            with pytest.raises(SaveError):
                stager.wait()
            assert not layout.is_committed(fs / "root" / "step-00000001")
            assert os.statvfs(fs).f_bavail >= free - 4, "the failed save's files still hold the space"
            assert stager.save(model, 2).result().step == 2  # the next save has room again
    finally:
        subprocess.run(["umount", "-l", str(fs)], check=False)
