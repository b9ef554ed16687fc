"""Step directory names, marker steps and sink places that used to pass without a word (issue 19, items 2,
7 and 8): every one is now correct behaviour or a named error that names the step, file or flag."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from stagerd.contract import commit_marker, layout
from stagerd.errors import MarkerError
from tests.cli_helpers import run_cli
from tests.daemon_helpers import fast_flags, stage_copy


@pytest.mark.parametrize(
    ("name", "step"),
    [
        ("step-00000100", 100),
        ("step-123456789", 123456789),
        (f"step-{2**63 - 1}", 2**63 - 1),
        ("step-000000100", None),  # a second spelling of step 100
        ("step-00000100\n", None),
        ("step-0000010\u0660", None),  # an Arabic-Indic zero
        (f"step-{2**63}", None),
        ("step-99999999999999999999", None),
        ("step-1", None),
    ],
)
def test_only_the_names_stagerd_writes_are_steps(name: str, step: int | None):
    assert layout.parse_step_dir(name) == step
    assert layout.looks_like_a_step_dir(name) == (step is None)


def test_a_marker_for_another_step_than_its_directory_is_a_marker_error(tmp_path, dcp_mixed2):
    model, _ = dcp_mixed2
    step_dir = stage_copy(tmp_path, 100, model, world=2)
    marker = json.loads((step_dir / layout.MARKER_NAME).read_text())
    (step_dir / layout.MARKER_NAME).write_text(json.dumps({**marker, "step": 777}))
    with pytest.raises(MarkerError, match="for step 777, but its directory is step 100"):
        commit_marker.read_marker(step_dir)
    r = run_cli(["consolidate", step_dir, tmp_path / "out"])
    assert r.returncode == 2 and "MarkerError" in r.stderr and not (tmp_path / "out").exists()


def test_a_marker_step_past_int64_is_refused():
    marker = commit_marker.CommitMarker(step=1, world_size=1, files=()).to_json()
    with pytest.raises(MarkerError, match=r"\[0, 2\^63\)"):
        commit_marker.CommitMarker.from_json({**marker, "step": 2**63})


def test_the_daemon_warns_about_odd_names_and_goes_on_with_real_steps(tmp_path, dcp_mixed2):
    model, _ = dcp_mixed2
    root, sink = tmp_path / "root", tmp_path / "sink"
    stage_copy(root, 100, model, world=2)
    for odd in ("step-000000100", "step-99999999999999999999"):
        (root / odd).mkdir()
        (root / odd / layout.MARKER_NAME).write_text("{}")
    r = run_cli(["watch", root, "--sink", sink.as_uri(), "--once", *fast_flags()])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "1 step(s) published, 0 not" in r.stdout
    for odd in ("step-000000100", "step-99999999999999999999"):
        assert f"{root / odd} is not a step directory" in r.stderr
    assert sorted(p.name for p in sink.iterdir() if p.name.startswith("step-")) == ["step-00000100"]


@pytest.mark.parametrize("where", [".", "step-00000100/published", ".stagerd/x"])
def test_a_local_sink_in_root_or_its_steps_is_refused_before_anything_is_written(tmp_path, where):
    root = tmp_path / "root"
    root.mkdir()
    sink = (root / where).resolve()
    r = run_cli(["watch", root, "--sink", sink.as_uri(), "--once", *fast_flags()])
    assert r.returncode == 2, r.stderr
    assert "ConfigError" in r.stderr and "inside its step or state directories" in r.stderr
    assert list(root.iterdir()) == []  # no journal, no lock, no sink directory


def test_a_step_past_int64_is_refused_by_the_stager_before_anything_starts():
    from stagerd.errors import SaveInputError
    from stagerd.training.save_inputs import resolve_state

    with pytest.raises(SaveInputError, match="2\\^63"):
        resolve_state({}, 2**63, None)


def test_a_marker_nested_too_deep_or_too_big_is_a_marker_error_and_other_steps_go_on(tmp_path, dcp_mixed2):
    """Before: a marker of 100,000 `[` raised RecursionError, an unnamed error retried as if it could pass
    (45 s instead of 1) and shown without its path; a marker was read whole before its 64 MiB limit
    applied (3 GiB of RSS for a 3 GiB file, MemoryError for this 1 TiB sparse one)."""
    model, _ = dcp_mixed2
    root, sink = tmp_path / "root", tmp_path / "sink"
    stage_copy(root, 100, model, world=2)
    deep = stage_copy(root, 101, model, world=2)
    (deep / layout.MARKER_NAME).write_text("[" * 100_000)
    with pytest.raises(MarkerError, match="nested too deep"):
        commit_marker.read_marker(deep)
    big = stage_copy(root, 1, model, world=2)
    with open(big / layout.MARKER_NAME, "wb") as f:
        f.truncate(1 << 40)  # sparse: 1 TiB that takes no disk, and would take 1 TiB of memory to read
    with pytest.raises(MarkerError, match="larger than 64 MiB"):
        commit_marker.read_marker(big)
    fifo = stage_copy(root, 2, model, world=2)
    (fifo / layout.MARKER_NAME).unlink()
    os.mkfifo(fifo / layout.MARKER_NAME)
    # Before: the daemon's scan read each marker whole for its identity: MemoryError, exit 1, nothing
    # published, for the big one; the FIFO held the scan (and every step) for good.
    r = run_cli(["watch", root, "--sink", sink.as_uri(), "--once", *fast_flags()], timeout=60)
    assert "1 step(s) published, 3 not" in r.stdout, r.stdout + r.stderr[-3000:]
    status = run_cli(["status", root, "--json"]).stdout  # the table wraps its errors at the terminal width
    assert "larger than 64 MiB" in status and "not a regular file" in status, status
    assert sorted(p.name for p in sink.iterdir() if p.name.startswith("step-")) == ["step-00000100"]


@pytest.mark.parametrize("shape", [[float("inf")], [2.5], [True], [-3], "12", [1e300]])
def test_a_marker_tensor_shape_that_is_not_non_negative_integers_is_a_marker_error(shape):
    """Before: Infinity (valid to json.loads) raised a raw OverflowError; 2.5, true, -3 and 1e300 were
    taken as shapes 2, 1, -3 and a 301-digit integer; "12" as (1, 2)."""
    marker = commit_marker.CommitMarker(step=1, world_size=1, files=()).to_json()
    marker["tensors"] = {"w": {"dtype": "F32", "shape": shape}}
    with pytest.raises(MarkerError, match="non-negative integers"):
        commit_marker.CommitMarker.from_json(json.loads(json.dumps(marker)))


def test_a_marker_created_past_any_float_is_a_marker_error():
    """Before: float() of a 401-digit integer raised a raw OverflowError out of CommitMarker.from_json."""
    marker = {**commit_marker.CommitMarker(step=1, world_size=1, files=()).to_json(), "created": 10**400}
    with pytest.raises(MarkerError, match="OverflowError"):
        commit_marker.CommitMarker.from_json(json.loads(json.dumps(marker)))


@pytest.mark.parametrize("where", ["raw", "step-00000100", "claims/x", "latest"])
def test_root_inside_a_local_sinks_own_places_is_refused_before_anything_is_written(tmp_path, where):
    """ROOT at `SINK/raw`: the sink's raw publish of step N would write into `SINK/raw/step-N`, the staged
    step itself, and the sink's retention delete it. A directory of the sink it never uses is left alone."""
    sink = tmp_path / "sink"
    root = sink / where
    root.mkdir(parents=True)
    r = run_cli(["watch", root, "--sink", sink.as_uri(), "--once", "--publish-raw", *fast_flags()])
    assert r.returncode == 2, r.stderr
    assert (
        f"ConfigError: ROOT {root} is inside sink {sink.as_uri()!r}, under its {where.split('/')[0]}"
        in r.stderr
    )
    assert "nothing was written" in r.stderr
    assert list(root.iterdir()) == []  # no journal, no lock
    staging = sink / "staging"
    staging.mkdir()
    r = run_cli(["watch", staging, "--sink", sink.as_uri(), "--once", *fast_flags()])
    assert r.returncode == 0, r.stderr[-3000:]


def test_nested_sinks_are_refused_before_anything_is_written(tmp_path):
    """`--sink file:///x --sink file:///x/sub`: the outer sink's listings and retention meet the inner
    one's steps (`x/raw` as the inner sink is the outer's raw tree)."""
    root, outer = tmp_path / "root", tmp_path / "x"
    root.mkdir()
    inner = outer / "raw"
    r = run_cli(["watch", root, "--sink", outer.as_uri(), "--sink", inner.as_uri(), "--once", *fast_flags()])
    assert r.returncode == 2, r.stderr
    said = f"stagerd: ConfigError: sink {inner.as_uri()!r} lies inside sink {outer.as_uri()!r}"
    assert said in r.stderr, r.stderr
    assert "side by side" in r.stderr  # the hint
    assert list(root.iterdir()) == [] and not outer.exists()


def test_once_names_a_step_without_its_marker_and_exits_0(tmp_path, dcp_mixed2):
    """Before, `--once` said nothing of a step directory left without its marker (a save killed before its
    commit): it is named once in the summary, with what committing it needs; not a failure."""
    model, _ = dcp_mixed2
    root, sink = tmp_path / "root", tmp_path / "sink"
    stage_copy(root, 100, model, world=2)
    shutil.copytree(model, root / "step-00000200" / "model")  # every shard, no marker
    r = run_cli(["watch", root, "--sink", sink.as_uri(), "--once", *fast_flags()])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "1 step(s) published, 0 not" in r.stdout
    said = (
        f"1 step(s) not committed, left alone: step-00000200 (committed once its {layout.MARKER_NAME} "
        "exists: the Stager writes it last, after every rank's save). Their tensors were not read and "
        "nothing of them was published; the next run takes each up once it is committed"
    )
    assert said in r.stdout and r.stderr.count(said) == 1, r.stdout + r.stderr[-3000:]
    assert sorted(p.name for p in sink.iterdir() if p.name.startswith("step-")) == ["step-00000100"]
