"""A ROOT that is a step directory, a directory inside one, or a ROOT's `.stagerd` (or inside it): `watch`
refuses it before writing anything (no journal and lock in the trainer's checkpoint) and names the ROOT it
is in, exit 2; `status` says the same instead of suggesting to watch it. A ROOT whose children are a
trainer's checkpoints (`--adopt`) is no step directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from stagerd.daemon.root_places import step_or_state_dir
from tests.cli_helpers import run_cli


def _tree(p: Path) -> list[str]:
    return sorted(str(q.relative_to(p)) for q in p.rglob("*"))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    (root / "step-00000001" / "model").mkdir(parents=True)
    (root / "step-00000001" / "stagerd.commit.json").write_text("{}")
    (root / "step-00000002" / "model").mkdir(parents=True)  # a save in progress: no marker yet
    (root / ".stagerd" / "adopted").mkdir(parents=True)
    return root


def test_watch_and_status_refuse_a_step_or_state_dir_as_root(root: Path, tmp_path: Path) -> None:
    before = _tree(root)
    for given, what in (
        ("step-00000001", "a step directory (it holds stagerd.commit.json)"),
        ("step-00000002", "a step directory (it is named step-00000002 with model/ inside)"),
        ("step-00000001/model", f"inside the step directory {root / 'step-00000001'}"),
        (".stagerd", "a ROOT's state directory"),
        (".stagerd/adopted", f"inside the state directory {root / '.stagerd'}"),
    ):
        r = run_cli(["watch", root / given, "--sink", (tmp_path / "sink").as_uri(), "--once"], timeout=60)
        assert r.returncode == 2 and f"stagerd: ConfigError: {root / given}: ROOT is {what}" in r.stderr, (
            r.stderr
        )
        assert f"`stagerd watch {root} --sink URL`" in r.stderr and "holds checkpoints" not in r.stderr, (
            r.stderr
        )
        assert _tree(root) == before and not (tmp_path / "sink").exists()
    r = run_cli(["status", root / "step-00000001"])
    assert r.returncode == 2 and "ROOT is a step directory" in r.stderr, r.stderr
    assert f"run `stagerd status {root}` instead" in r.stderr and "stagerd watch" not in r.stderr, r.stderr


def test_a_root_of_checkpoints_is_no_step_dir(tmp_path: Path) -> None:
    for ckpt in ("step-00000100", "step-100", "checkpoint-5"):  # torchtitan's, HF Trainer's
        (tmp_path / "run" / ckpt).mkdir(parents=True)
        (tmp_path / "run" / ckpt / ".metadata").write_bytes(b"")
    assert step_or_state_dir(tmp_path / "run") is None
    assert (
        step_or_state_dir(tmp_path / "run" / "exports") is None
    )  # a directory under a ROOT, as watch allows


def test_both_floors_tell_a_step_directory_alike(tmp_path: Path) -> None:
    """`watch`'s ROOT and the commands' local outputs are told from a step directory by one test
    (`layout.why_a_step_dir`): a save in progress (`step-N` with `model/`, no marker yet) outside any ROOT
    is a step directory to both."""
    from stagerd.cmd.staging_places import staging_area

    saving = tmp_path / "loose" / "step-00000003"
    (saving / "model").mkdir(parents=True)
    assert step_or_state_dir(saving / "export") is not None
    assert staging_area(saving / "export") == f"inside the staged step or state directory {saving}"
    (tmp_path / "loose" / "step-00000004").mkdir()  # a name alone, nothing a save writes: no step yet
    assert step_or_state_dir(tmp_path / "loose" / "step-00000004") is None
    assert staging_area(tmp_path / "loose" / "step-00000004" / "export") is None


def test_watch_adopt_refuses_a_trainer_checkpoint_as_root(tmp_path: Path) -> None:
    """ROOT that is itself a finished HF Trainer checkpoint: refused before anything is written (no
    `.stagerd/` in the trainer's checkpoint), naming the folder that holds it; given the run directory one
    level too high, the folder of checkpoints in it is named in a warning that says to pass it."""
    from tests.adopt.helpers import watch_once

    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "checkpoint-6"
    ckpt.mkdir(parents=True)
    (ckpt / "model.safetensors").write_bytes(b"")
    (ckpt / "trainer_state.json").write_text("{}")
    before = _tree(run)
    r = watch_once(ckpt, tmp_path / "sink")
    assert r.returncode == 2, r.stderr
    assert f"ConfigError: {ckpt}: ROOT is one of the trainer's checkpoints" in r.stderr, r.stderr
    hint = f"`stagerd watch {run / 'checkpoints'} --adopt"
    assert "an --adopt hf-trainer checkpoint" in r.stderr and hint in r.stderr, r.stderr
    assert _tree(run) == before and not (tmp_path / "sink").exists()
    r = watch_once(run, tmp_path / "sink")
    assert r.returncode == 0, r.stderr
    warned = [ln for ln in r.stderr.splitlines() if '"level": "warning"' in ln]
    said = f"{run / 'checkpoints'} gives no step number, so --adopt ignores it, but it holds checkpoints"
    assert [said in ln and hint in ln for ln in warned] == [True], r.stderr
    assert said in r.stdout and hint in r.stdout, r.stdout  # and the --once summary says it too
