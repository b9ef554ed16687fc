"""Disk full during export, on filesystems that really run out.

- A size-limited tmpfs mounted for the test (needs CAP_SYS_ADMIN; the tests that need it are skipped with
  the reason where mounting is refused): the staging root itself fills up, at every point of the export in
  turn, by bytes and by inodes; `stagerd consolidate` into a full OUT; `stagerd watch --once` on a full ROOT.
- RLIMIT_FSIZE in a child process, which works unprivileged: the kernel refuses writes past the limit with
  EFBIG.

Every case must end the same way: an OutputError with a message (exit 3, retryable), no `export/`, no
`export.tmp/`, no OUT, and the staged step byte for byte as it was, still committed.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from stagerd.contract import layout
from stagerd.engine.export import export_step
from stagerd.engine.verify import verify_export
from stagerd.errors import OutputError
from tests.cli_helpers import run_cli, start_cli
from tests.daemon.fullfs import PAGE, WATCH_FLAGS, full_root, remount, snapshot, usage


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


def assert_cli_output_error(r: subprocess.CompletedProcess, words: str) -> None:
    assert r.returncode == 3, r.stderr  # retryable
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("stagerd:")]
    assert len(lines) == 1 and "OutputError" in lines[0] and words in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_consolidate_into_a_full_out(step_dir, tmpfs):
    fs = tmpfs(2 * PAGE)
    before = snapshot(step_dir)

    r = run_cli(["consolidate", step_dir, fs / "out"])

    assert_cli_output_error(r, "no space left")
    assert list(fs.iterdir()) == []  # neither OUT nor its temp sibling
    assert snapshot(step_dir) == before


def _limit_file_size(limit: int) -> Callable[[], None]:
    def apply() -> None:
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def test_a_file_size_limit_is_a_clean_output_error(step_dir, tmp_path):
    """Unprivileged: RLIMIT_FSIZE makes the kernel refuse the write (EFBIG) past `limit` bytes."""
    before = snapshot(step_dir)
    out = tmp_path / "out"

    r = run_cli(["consolidate", step_dir, out], preexec=_limit_file_size(4096))

    assert_cli_output_error(r, "File too large")
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == [step_dir.name]
    assert snapshot(step_dir) == before

    ok = run_cli(["consolidate", step_dir, out], preexec=_limit_file_size(1 << 30))
    assert ok.returncode == 0, ok.stderr


def test_watch_once_on_a_full_root_records_a_failed_step(step_dir, tmpfs, tmp_path):
    root = full_root(step_dir, tmpfs, tmp_path / "state")
    step = root / step_dir.name
    before = snapshot(step)
    sink = tmp_path / "published"

    r = run_cli(["watch", root, "--sink", sink.as_uri(), *WATCH_FLAGS, "--max-attempts", "1"])

    assert r.returncode != 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert "step 100" in r.stdout and "no space left" in r.stdout, r.stdout
    assert snapshot(step) == before
    assert not (step / layout.EXPORT_DIR).exists() and not (step / layout.EXPORT_TMP_DIR).exists()
    assert not sink.exists() or not any(sink.rglob("*.safetensors"))
    status = run_cli(["status", root, "--json"])
    assert status.returncode == 0, status.stderr
    (s,) = json.loads(status.stdout)["steps"]
    assert s["step"] == 100 and s["state"] == "quarantined"
    assert s["error_class"] == "OutputError" and "no space left" in s["error_message"]


def test_watch_retries_the_export_once_space_is_freed(step_dir, tmpfs, tmp_path):
    root = full_root(step_dir, tmpfs, tmp_path / "state")
    sink = tmp_path / "published"
    env = {"STAGERD_RETRY_BASE_SECONDS": "1", "STAGERD_MAX_ATTEMPTS": "3"}
    proc = start_cli(["watch", root, "--sink", sink.as_uri(), *WATCH_FLAGS], env=env)
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
