"""What `restore` and `consolidate` may replace on the local disk, run as a user runs them: each refuses a
place among a staging ROOT's steps, a link as OUT, and an uncommitted step directory holding the user's own
files, by a named error before anything downloads or is built, and leaves every file where it was."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stagerd.contract import layout
from stagerd.sinks.fsspec import FsspecSink
from tests.cli_helpers import run_cli
from tests.cmd.restore_helpers import raw_step, run_restore, tree


@pytest.fixture
def published(tmp_path: Path, dcp_mixed2) -> tuple[Path, str]:
    """(a staging ROOT with committed steps 1 and 2, a file:// sink holding both raw and step 2's export)."""
    root, sink_dir = tmp_path / "orig", tmp_path / "sink"
    sink = FsspecSink.from_url(sink_dir.as_uri())
    for s in (1, 2):
        sink.publish_raw(raw_step(root, s, dcp_mixed2[0]), s)
    export = tmp_path / "hf-2"
    r = run_cli(["consolidate", root / layout.step_dir_name(2), export])
    assert r.returncode == 0, r.stderr
    sink.publish(export, 2)
    return root, sink_dir.as_uri()


def _everything(d: Path) -> list[str]:
    """Every name under `d`, links and empty directories included."""
    return sorted(
        os.path.relpath(os.path.join(top, n), d) for top, dirs, files in os.walk(d) for n in dirs + files
    )


def test_a_raw_restore_replaces_an_uncommitted_step_only_when_it_holds_nothing_of_the_users(
    published, tmp_path
):
    """Before: `ROOT/step-N` without a marker was removed whole before the landing, the user's `notes.txt`
    and `hf/` with it; a file at that name was a `NotADirectoryError` traceback after the download."""
    _, url = published
    root = tmp_path / "root"
    step_dir = root / layout.step_dir_name(2)
    (step_dir / "model").mkdir(parents=True)
    (step_dir / "model" / "__0_0.distcp").write_bytes(b"a crashed save's")
    (step_dir / "notes.txt").write_text("mine")
    (step_dir / "hf").mkdir()
    (step_dir / "hf" / "config.json").write_text("{}")
    (root / "step-2").mkdir()  # a user's own directory, not a step name
    (root / "step-2" / "keep").write_text("mine too")
    before = tree(root)
    r = run_restore(url, root, "--step", "2")
    assert r.returncode == 2 and "StepExistsError" in r.stderr, r.stderr
    assert "is not committed and holds hf, notes.txt, which no save writes" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "restore step 2:" not in r.stderr  # refused before a download
    assert {k: v for k, v in tree(root).items() if not k.startswith(".stagerd/")} == before
    assert not (root / layout.STATE_DIR / "restore").exists()

    (step_dir / "notes.txt").unlink()
    (step_dir / "hf" / "config.json").unlink()
    (step_dir / "hf").rmdir()
    r = run_restore(url, root, "--step", "2")  # only a crashed save's names left: replaced
    assert r.returncode == 0, r.stderr
    assert layout.is_committed(step_dir) and (root / "step-2" / "keep").read_text() == "mine too"

    (root / layout.step_dir_name(1)).write_text("a file, not a step")
    r = run_restore(url, root, "--step", "1")
    assert r.returncode == 2 and "StepExistsError" in r.stderr and "is not a directory" in r.stderr, r.stderr
    assert (
        "Traceback" not in r.stderr and (root / layout.step_dir_name(1)).read_text() == "a file, not a step"
    )


def test_restore_and_consolidate_refuse_a_place_among_the_staged_steps(published, tmp_path):
    """Before: `restore --export` and `consolidate` into `ROOT/step-1/export` wrote another step's weights
    where the daemon takes them for step 1's own export and publishes them; into `ROOT/step-00000009`, a
    marker-less step directory; a raw restore into a committed step nested a ROOT that retention deletes."""
    orig, url = published
    step1 = orig / layout.step_dir_name(1)
    before = _everything(orig)
    cases = [
        (["restore", url, step1, "--step", "2"], "ROOT is inside the staged step or state directory"),
        (["restore", url, step1 / "export", "--export", "--step", "2"], "OUT is inside the staged step"),
        (["restore", url, orig / "step-00000009", "--export", "--step", "2"], "inside a step directory of"),
        (["restore", url, orig / ".stagerd" / "eval", "--export", "--step", "2"], "state directory"),
        (["consolidate", orig / layout.step_dir_name(2), step1 / "export"], "OUT is inside the staged step"),
        (["consolidate", orig / layout.step_dir_name(2), orig / "step-00000009"], "inside a step directory"),
    ]
    (orig / ".stagerd").mkdir()
    before = _everything(orig)
    for argv, said in cases:
        r = run_cli(argv)
        assert r.returncode == 2 and "stagerd: ConfigError: " in r.stderr and said in r.stderr, (
            argv,
            r.stderr,
        )
        assert "Traceback" not in r.stderr and "nothing was changed" in r.stderr
        assert _everything(orig) == before, argv
    # a directory of one's own under ROOT, beside the steps, is allowed (as a local sink is)
    r = run_cli(["restore", url, orig / "evals" / "step-2", "--export", "--step", "2"])
    assert r.returncode == 0, r.stderr
    assert tree(orig / "evals" / "step-2") == tree(tmp_path / "hf-2")


def test_consolidate_onto_a_link_is_a_symlink_error_and_touches_neither_end(published, tmp_path):
    """Before: OUT a link to an empty directory, or a dangling one, built the whole export and then failed
    with a `NotADirectoryError` traceback (exit 1)."""
    orig, _ = published
    target = tmp_path / "empty"
    target.mkdir()
    (tmp_path / "to-empty").symlink_to(target)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    names = sorted(os.listdir(tmp_path))
    for out in (tmp_path / "to-empty", tmp_path / "dangling"):
        r = run_cli(["consolidate", orig / layout.step_dir_name(1), out])
        assert r.returncode == 2 and "stagerd: SymlinkError: " in r.stderr, r.stderr
        assert "OUT is a symbolic link" in r.stderr and "Traceback" not in r.stderr
        assert "consolidate step-" not in r.stderr  # refused before any work
    assert sorted(os.listdir(tmp_path)) == names and not any(target.iterdir())
    assert not (tmp_path / "nowhere").exists()
