"""`stagerd consolidate` and `stagerd verify`: a wrong OUT or a missing path is bad input (exit 2) that
names the path, and nothing is written; the good path still works."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from stagerd.cmd.verify import check_manifest
from stagerd.contract import layout
from stagerd.errors import VerifyError
from tests.cli_helpers import run_cli


def _one_error(proc, name: str, *words: str) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("stagerd:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(f"stagerd: {name}: ") and all(w in lines[0] for w in words), lines[0]
    return lines[0]


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_consolidate_into_a_non_empty_dir_is_exit_2(step_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    proc = run_cli(["consolidate", step_dir, out])
    assert proc.returncode == 2
    _one_error(proc, "ConfigError", str(out), "not empty")
    assert _tree(out) == {"keep.txt": b"mine"}


def test_consolidate_onto_a_file_is_exit_2(step_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"precious")
    proc = run_cli(["consolidate", step_dir, out])
    assert proc.returncode == 2
    _one_error(proc, "ConfigError", str(out), "is a file")
    assert out.read_bytes() == b"precious"


@pytest.mark.parametrize("below", ["out", "sub/out"])
def test_consolidate_under_a_file_is_exit_2(step_dir: Path, tmp_path: Path, below: str) -> None:
    """Before the fix: OutputError "File exists" or "Not a directory", exit 3, with a free-space hint."""
    (tmp_path / "mine").mkdir()
    a_file = tmp_path / "mine" / "notes.txt"
    a_file.write_bytes(b"precious")
    proc = run_cli(["consolidate", step_dir, a_file / below])
    assert proc.returncode == 2
    _one_error(proc, "ConfigError", f"a parent of OUT, {a_file}, is a file")
    assert a_file.read_bytes() == b"precious" and [p.name for p in a_file.parent.iterdir()] == ["notes.txt"]


@pytest.mark.parametrize("where", [".", "model", "model/hf", "export-here"])
def test_consolidate_into_the_source_is_refused(step_dir: Path, where: str) -> None:
    before = _tree(step_dir)
    out = step_dir / where
    proc = run_cli(["consolidate", step_dir, out])
    assert proc.returncode == 2
    _one_error(proc, "ConfigError", "inside the source")
    assert _tree(step_dir) == before
    assert not [p for p in step_dir.rglob(".*stagerd-tmp*")]


def test_consolidate_of_a_shard_dir_into_itself_is_refused(step_dir: Path) -> None:
    model = step_dir / layout.MODEL_DIR
    before = _tree(model)
    proc = run_cli(["consolidate", model, model / "out"])
    assert proc.returncode == 2
    _one_error(proc, "ConfigError", "inside the source")
    assert _tree(model) == before


def test_consolidate_of_a_missing_src_says_so(tmp_path: Path) -> None:
    proc = run_cli(["consolidate", tmp_path / "nope", tmp_path / "out"])
    assert proc.returncode == 2
    _one_error(proc, "ConfigError", str(tmp_path / "nope"), "does not exist")
    assert not (tmp_path / "out").exists()


def test_a_file_given_for_a_directory_is_named_so(tmp_path: Path, capsys) -> None:
    """Before: `verify FILE` named its index's NotADirectoryError, `consolidate FILE` and `--against FILE`
    hinted at an abandoned step, `restore --export FILE` called it a non-empty directory, and `publish` of
    a step directory hinted at --step where its export is what it takes."""
    from stagerd.cli import main

    file = tmp_path / "a-file"
    file.write_text("x")
    step = tmp_path / layout.step_dir_name(7)
    (step / layout.EXPORT_DIR).mkdir(parents=True)
    for argv, said, hint in (
        (["verify", str(file)], "EXPORT_DIR is a file, not a directory", "give the export's directory"),
        (
            ["verify", str(tmp_path), "--against", str(file)],
            "--against is a file",
            "give the step's directory",
        ),
        (["consolidate", str(file), str(tmp_path / "out")], "SRC is a file", "(ROOT/step-N)"),
        (
            ["restore", (tmp_path / "sink").as_uri(), str(file), "--export", "--step", "1"],
            "is a file",
            "new or",
        ),
        (
            ["publish", str(step), "--sink", str(tmp_path / "sink")],
            "cannot tell the step",
            "give its export, ",
        ),
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert said in err and hint in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "sink").exists()


def test_verify_of_a_step_or_a_folder_of_steps_names_the_export_meant(tmp_path: Path, capsys) -> None:
    """Before: each was "neither model.safetensors.index.json nor model.safetensors: not a complete
    export", hinting to consolidate again."""
    from stagerd.cli import main

    root = tmp_path / "root"
    step = root / layout.step_dir_name(6)
    (step / layout.EXPORT_DIR).mkdir(parents=True)
    (step / layout.MARKER_NAME).write_text("{}")
    sink = tmp_path / "sink"
    (sink / layout.step_dir_name(4)).mkdir(parents=True)
    (sink / layout.step_dir_name(6)).mkdir()
    for given, said, hint in (
        (step, "is a staged step, not an export", f"stagerd verify {step / layout.EXPORT_DIR} --against"),
        (root, "holds step directories", f"e.g. {step}"),
        (sink, "holds step directories", f"e.g. {sink / layout.step_dir_name(6)}"),
    ):
        assert main(["verify", str(given)]) == 2, given
        err = capsys.readouterr().err
        assert said in err and hint in err and "not a complete export" not in err, err


@pytest.mark.parametrize(("flag", "value"), [("--max-shard-size", "0"), ("--threads", "0")])
def test_consolidate_bad_numbers_are_exit_2(step_dir: Path, tmp_path: Path, flag: str, value: str) -> None:
    proc = run_cli(["consolidate", step_dir, tmp_path / "out", flag, value])
    assert proc.returncode == 2
    _one_error(proc, "ConfigError", flag)
    assert not (tmp_path / "out").exists()


def test_consolidate_into_an_empty_dir_then_verify(step_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    proc = run_cli(["consolidate", step_dir, out])
    assert proc.returncode == 0, proc.stderr
    assert (out / layout.WEIGHTS_NAME).is_file() and not (out / layout.INDEX_NAME).exists()
    check = run_cli(["verify", out, "--against", step_dir])
    assert check.returncode == 0, check.stderr
    assert check.stdout.startswith("ok: ") and f"every byte equal to {step_dir}" in check.stdout


@pytest.mark.parametrize("which", ["export", "against"])
def test_verify_of_a_missing_path_says_it_is_missing(step_dir: Path, tmp_path: Path, which: str) -> None:
    missing = tmp_path / "nonexistent"
    args = ["verify", missing] if which == "export" else ["verify", step_dir, "--against", missing]
    proc = run_cli(args)
    assert proc.returncode == 2
    line = _one_error(proc, "ConfigError", str(missing), "does not exist")
    assert "not a complete export" not in line


@pytest.mark.parametrize(
    ("write", "match"),
    [
        (lambda p: p.write_text("[" * 100_000 + "]" * 100_000), "nested too deep"),
        (lambda p: os.truncate(p, 400 << 20), "larger than 64 MiB"),
        (lambda p: p.write_text('{"format": 5}'), "not a stagerd.manifest/"),
        (lambda p: p.write_text("[1]"), "cannot read the manifest"),
    ],
    ids=["deep", "huge", "not-a-manifest", "a-list"],
)
def test_verify_of_a_bad_manifest_names_it(
    tmp_path: Path, write: Callable[[Path], object], match: str
) -> None:
    """A manifest nested past the interpreter's recursion limit, or of hundreds of MiB (a sparse file),
    is a VerifyError naming it, read in bounded memory, never a traceback."""
    path = tmp_path / layout.MANIFEST_NAME
    path.touch()
    write(path)
    with pytest.raises(VerifyError, match=match) as e:
        check_manifest(tmp_path)
    assert e.value.path == str(path) and e.value.message.count(str(path)) == 0
