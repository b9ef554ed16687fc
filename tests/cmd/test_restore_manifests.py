"""`stagerd restore` of raw steps whose manifest or node markers were written by someone else: each defect
is a `RestoreError` naming the sink's file, nothing lands in ROOT and no temp directory is left; a legit
step with more files than the process may hold open comes back whole."""

from __future__ import annotations

import hashlib
import json
import resource
from collections.abc import Callable
from pathlib import Path

import pytest

from stagerd.cmd.restore import restore_raw
from stagerd.contract import commit_marker, layout
from stagerd.errors import RestoreError
from stagerd.sinks.fetch import RemoteStore
from tests.cli_helpers import run_cli

STEP = 3


def _marker(files: dict[str, bytes], node: int = 0, nodes: int = 1) -> bytes:
    staged = tuple(commit_marker.StagedFile(p, len(b)) for p, b in files.items())
    m = commit_marker.CommitMarker(
        step=STEP, world_size=1, files=staged, staging_node=node, staging_nodes=nodes
    )
    return json.dumps(m.to_json()).encode()


def _entries(files: dict[str, bytes]) -> list[dict]:
    return [{"path": p, "size": len(b), "sha256": hashlib.sha256(b).hexdigest()} for p, b in files.items()]


def _part(part: Path, files: dict[str, bytes], edit: Callable[[dict], None] = lambda m: None) -> None:
    """`files` under `part`, and a raw manifest listing them, changed by `edit` after it is made."""
    for rel, data in files.items():
        (part / rel).parent.mkdir(parents=True, exist_ok=True)
        (part / rel).write_bytes(data)
    manifest = {"format": layout.MANIFEST_FORMAT, "step": STEP, "files": _entries(files)}
    manifest["metadata"] = {"raw": True}
    edit(manifest)
    (part / layout.MANIFEST_NAME).write_text(json.dumps(manifest))


def _one_part(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def build(raw: Path) -> None:
        files = {"model/a": b"x", "model/b": b"yy"}
        _part(raw, {**files, layout.MARKER_NAME: _marker(files)}, edit)

    return build


def _nodes(marker_of: Callable[[int, dict[str, bytes]], bytes], name_of=lambda k: f"n{k}") -> Callable:
    def build(raw: Path) -> None:
        for k in range(2):
            files = {name_of(k): b"x"}
            _part(raw / f"node-{k:05d}-of-00002", {**files, layout.MARKER_NAME: marker_of(k, files)})

    return build


def _deep(raw: Path) -> None:
    _one_part(lambda m: None)(raw)
    (raw / layout.MANIFEST_NAME).write_text("[" * 100_000)


def _sha(m: dict) -> None:
    m["files"][0]["sha256"] = "../" * 30


CASES = {
    # before: raw RecursionError, exit 1
    "a manifest nested too deep": (_deep, "nested too deep"),
    # before: raw OverflowError (float() of a 401-digit integer), exit 1
    "a created time past any float": (_one_part(lambda m: m.update(created=10**400)), "malformed manifest"),
    # before: raw FileExistsError, exit 1
    "a file listed twice": (_one_part(lambda m: m["files"].append(m["files"][0])), "listed twice"),
    # before: a MarkerError from the marker check, after the download; now refused before it
    "a file and a directory of one name": (
        _one_part(lambda m: m["files"].append({**m["files"][0], "path": "model/a/c"})),
        "inside it",
    ),
    # before: accepted, step 3.7 taken for 3
    "a step that is not an integer": (_one_part(lambda m: m.update(step=3.7)), "not an integer"),
    # before: accepted, True taken for a size of 1
    "a size that is a boolean": (_one_part(lambda m: m["files"][0].update(size=True)), "bool"),
    "a sha256 that is not one": (_one_part(_sha), "64 hex digits"),
    # before: raw json.JSONDecodeError, exit 1
    "a node marker that is not JSON": (_nodes(lambda k, f: b"{not json"), "not JSON"),
    # before: raw FileNotFoundError from os.rename, exit 1
    "a node marker listing a file its node lacks": (
        _nodes(lambda k, f: _marker({**f, "ghost": b"zz"}, k, 2)),
        "ghost",
    ),
    # before: raw FileExistsError from mkdir, exit 1
    "two nodes' files clashing as file and directory": (
        _nodes(lambda k, f: _marker(f, k, 2), name_of=lambda k: "a" if k == 0 else "a/b"),
        "inside it",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_raw_step_is_a_restore_error_and_nothing_lands(tmp_path, case):
    build, text = CASES[case]
    sink, root = tmp_path / "sink", tmp_path / "root"
    build(sink / "raw" / layout.step_dir_name(STEP))
    store = RemoteStore.open(sink.as_uri())
    try:
        with pytest.raises(RestoreError, match=text) as e:
            restore_raw(store, root, STEP)
    finally:
        store.close()
    assert str(sink) in str(e.value) and "\n" not in e.value.message
    assert not root.exists()  # the ROOT the restore made is gone with it


def test_a_step_of_more_files_than_may_be_open_at_once_comes_back_whole(tmp_path):
    """Before: every file was held open for the whole download: `OSError: [Errno 24] Too many open files`
    (exit 1) for a raw step of 300 files under a soft RLIMIT_NOFILE of 256 (1024 is a common default)."""
    sink, root = tmp_path / "sink", tmp_path / "root"
    files = {f"optim/__{i}_0.distcp": i.to_bytes(4, "little") * 8 for i in range(300)}
    _part(sink / "raw" / layout.step_dir_name(STEP), {**files, layout.MARKER_NAME: _marker(files)})
    res = run_cli(
        ["restore", sink.as_uri(), root, "--step", str(STEP)],
        preexec=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256)),
    )
    assert res.returncode == 0, res.stderr[-600:]
    step = root / layout.step_dir_name(STEP)
    assert layout.is_committed(step)
    assert {rel: (step / rel).read_bytes() for rel in files} == files


@pytest.mark.parametrize("text", ["²", "\u0661", "9999999999999999999", "-1", "1e3", ""])
def test_a_step_flag_that_is_not_an_ascii_step_number_is_a_config_error(text):
    """Before: '²' and 2^63 or more raised a raw ValueError (exit 1), and U+0661 (an Arabic-Indic 1)
    restored step 1."""
    from stagerd.cmd.restore import _step
    from stagerd.errors import ConfigError

    with pytest.raises(ConfigError, match="--step must be"):
        _step(text)
    assert _step("latest") is None and _step(str(2**63 - 1)) == 2**63 - 1


@pytest.mark.parametrize("latest", ["directory", "link", "large"])
def test_a_latest_another_tool_wrote_is_a_restore_error_naming_it(tmp_path, latest):
    """Before: `latest` a directory (or a link to one) on file:// was a retryable SinkError (exit 3), as if
    the store were down."""
    from stagerd.sinks.fetch import resolve_step

    sink = tmp_path / "sink"
    (sink / "ckpt-9").mkdir(parents=True)
    if latest == "directory":
        (sink / "latest").mkdir()
    elif latest == "link":
        (sink / "latest").symlink_to("ckpt-9")
    else:
        (sink / "latest").write_text("x" * 2048)
    store = RemoteStore.open(sink.as_uri())
    try:
        with pytest.raises(RestoreError, match="names no step") as e:
            resolve_step(store, None, raw=False)
    finally:
        store.close()
    assert e.value.retryable is False and str(sink / "latest") in str(e.value)
