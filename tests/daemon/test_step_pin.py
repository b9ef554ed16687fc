"""A step a trainer pins (the HF Trainer's best checkpoint, read back at the end of training) is kept by the
daemon's retention, beside the newest `keep_last` others, for as long as the trainer holds it, and no
longer: a pin is a `flock`, released with its holder's file descriptor."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

from stagerd.contract import layout
from stagerd.contract.step.pin import StepPin, pinned
from stagerd.daemon.retention import StepView, plan_retention
from tests.cli_helpers import REPO, clean_env, run_cli
from tests.daemon_helpers import fast_flags, stage_copy


def test_a_pinned_step_is_kept_and_is_not_one_of_the_newest_kept():
    steps = [StepView(1, True, pinned=True), StepView(2, True), StepView(3, True), StepView(4, True)]
    assert plan_retention(steps, 2) == [2]
    assert plan_retention(steps, 0) == [2, 3, 4]


def test_the_daemon_keeps_a_pinned_step_until_the_pin_is_released(tmp_path, dcp_mixed2):
    model, _ = dcp_mixed2
    root, sink = tmp_path / "root", tmp_path / "sink"
    for step in (100, 200, 300):
        stage_copy(root, step, model, world=2)
    args = ["watch", root, "--sink", sink.as_uri(), "--once", "--keep-last", "1", *fast_flags()]
    pin = StepPin(root, 100).hold()
    try:
        held = run_cli(args)
        assert held.returncode == 0, held.stderr[-3000:]
        assert [p.name for p in sorted(root.glob("step-*"))] == ["step-00000100", "step-00000300"]
        assert "step 100: kept while a trainer pins it" in held.stderr
        status = json.loads(run_cli(["status", root, "--json"]).stdout)
        assert {s["step"]: s["pinned"] for s in status["steps"]} == {100: True, 300: False}
    finally:
        pin.release()
    # the Trainer callback's newest step names step 100 its best, as a resumed run's load_best_model_at_end
    # reads it: kept once the training (and its pin) ended, until the newest step names another (or none)
    state = root / layout.step_dir_name(300) / layout.EXTRAS_DIR / "trainer_state.json"
    state.parent.mkdir(exist_ok=True)
    state.write_text(json.dumps({"best_model_checkpoint": f"/other/node/root/{layout.step_dir_name(100)}"}))
    best = run_cli(args)
    assert best.returncode == 0, best.stderr[-3000:]
    assert [p.name for p in sorted(root.glob("step-*"))] == ["step-00000100", "step-00000300"]
    status = json.loads(run_cli(["status", root, "--json"]).stdout)
    assert {s["step"]: s["pinned"] for s in status["steps"]} == {100: True, 300: False}
    state.write_text(json.dumps({"best_model_checkpoint": None}))
    released = run_cli(args)
    assert released.returncode == 0, released.stderr[-3000:]
    assert [p.name for p in sorted(root.glob("step-*"))] == ["step-00000300"]
    assert (sink / layout.step_dir_name(100) / layout.MANIFEST_NAME).is_file()  # published before it went
    assert not (root / ".step-00000100.pin").exists()


def test_the_newest_readable_record_of_best_steps_names_those_still_here(tmp_path):
    """Lightning's plugin records its `ModelCheckpoint`s' best steps in each step it stages
    (`extras/stagerd.best.json`): retention keeps those the newest record names, where they are still under
    ROOT; a record that does not parse is passed over for the one before it, as a `trainer_state.json` is."""
    from stagerd.contract import best_steps
    from stagerd.daemon.trainers_best import staged_best

    def record(step: int, data: bytes) -> None:
        (root / layout.step_dir_name(step) / layout.EXTRAS_DIR / best_steps.NAME).write_bytes(data)

    root = tmp_path / "root"
    for step in (1, 2, 3):
        (root / layout.step_dir_name(step) / layout.EXTRAS_DIR).mkdir(parents=True)
        (root / layout.step_dir_name(step) / layout.MARKER_NAME).write_text("{}")
    assert staged_best(root) == set()
    record(2, best_steps.encode([1]))
    assert staged_best(root) == {1}
    record(3, best_steps.encode([2, 9]))  # step 9 is not here (deleted by hand): nothing to keep
    assert staged_best(root) == {2}
    record(3, b'{"format": "stagerd.best/1", "steps": [true]}')
    assert staged_best(root) == {1}
    record(3, best_steps.encode([]))  # no best any more
    assert staged_best(root) == set()


def test_a_pin_dies_with_its_holder(tmp_path):
    code = "import sys; from stagerd.contract.step.pin import StepPin; StepPin(sys.argv[1], 7).hold(); "
    code += "print('held', flush=True); sys.stdin.read()"
    child = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)],
        cwd=REPO,
        env=clean_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == b"held\n"
        assert pinned(tmp_path, 7) and not pinned(tmp_path, 8)
        child.send_signal(signal.SIGKILL)
        child.wait()
        assert not pinned(tmp_path, 7)
    finally:
        child.kill()
        child.wait()


def test_a_pin_file_of_another_user_still_keeps_the_step():
    """The trainer and the daemon may run as different users: the pin file the trainer made (umask 022:
    read-only to others) is still locked by retention, which needs no write access for a `flock`."""
    import os
    import shutil
    import tempfile

    root = tempfile.mkdtemp(dir="/tmp")  # not under pytest's 0700 tmp: another user must reach it
    try:
        os.chmod(root, 0o755)
        pin = StepPin(root, 5).hold()
        try:
            os.chmod(pin.path, 0o444)  # what the daemon's user may do with another user's pin file
            euid = os.geteuid()
            if euid == 0:  # root may write anything: check as another user
                os.seteuid(65534)
            try:
                assert pinned(root, 5)
                other = StepPin(root, 5).hold()  # another rank, as that other user: held too
                assert other._fd is not None
                other.release()
            finally:
                if euid == 0:
                    os.seteuid(0)
        finally:
            pin.release()
        assert not pinned(root, 5)
    finally:
        shutil.rmtree(root)


async def test_a_step_kept_for_its_pin_then_for_a_save_says_both(tmp_path, dcp_mixed2):
    """A running daemon says once why it keeps a step. A step kept while pinned, then (pin released) kept
    because a Stager is saving it again, must say the second reason too: the two share no "said" mark."""
    import asyncio

    from stagerd.contract.step.lock import StepLock
    from tests.cli_helpers import clean_env
    from tests.daemon_helpers import start_watch

    model, _ = dcp_mixed2
    root, sink = tmp_path / "root", tmp_path / "sink"
    for step in (100, 200, 300):
        stage_copy(root, step, model, world=2)
    pin = StepPin(root, 100).hold()
    env = clean_env({"STAGERD_DISK_CHECK_SECONDS": "0.2"})
    args = ["--sink", sink.as_uri(), "--keep-last", "1", *fast_flags()]
    w = await start_watch(root, *args, log_dir=tmp_path / "log", env=env)
    try:
        await w.wait_for(lambda r: "step 100: kept while a trainer pins it" in r.get("msg", ""))
        with StepLock(root, 100, "a Stager save"):
            pin.release()
            await w.wait_for(lambda r: "step 100: staged data kept" in r.get("msg", ""))
        await w.wait_for(lambda r: r.get("step") == 100 and r.get("state") == "retired")
    finally:
        pin.release()
        w.kill(signal.SIGTERM)
        await asyncio.wait_for(w.proc.wait(), 30)
    assert not (root / layout.step_dir_name(100)).exists()
