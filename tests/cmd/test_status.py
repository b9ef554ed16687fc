"""`stagerd status` fits the terminal, keeps every detail in `--json`, and explains a ROOT it cannot read.

The journal is a real one: `stagerd watch --once` runs on a ROOT with a torn step (quarantined with a long
ShardError) and two sinks, one of which is down (every lane left waiting with a long SinkError).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from stagerd.contract import layout
from tests.cli_helpers import run_cli
from tests.daemon_helpers import fast_flags, stage_copy, truncate_a_shard

STEPS = (1, 2, 3)


@pytest.fixture(scope="module")
def journal_root(tmp_path_factory, dcp_mixed2) -> tuple[Path, list[str]]:
    base = tmp_path_factory.mktemp("status")
    root = base / "root"
    root.mkdir()
    src, _ = dcp_mixed2
    for step in STEPS:
        stage_copy(root, step, src, 2)
    truncate_a_shard(root / layout.step_dir_name(2))
    (base / "down").symlink_to(base / "mnt" / "sink")  # a sink whose filesystem is not mounted
    good = base / "published" / "a-rather-long-directory-name" / "for-the-checkpoints" / "of-run-one"
    sinks = [good.as_uri(), (base / "down").as_uri()]
    argv = ["watch", root, "--once", "--max-attempts", "1", *fast_flags()]
    for sink in sinks:
        argv += ["--sink", sink]
    proc = run_cli(argv, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    return root, sinks


def _json(root: Path) -> dict[str, Any]:
    proc = run_cli(["status", root, "--json"])
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("columns", [80, 100, 132, 200])
def test_status_fits_the_terminal(journal_root, columns: int) -> None:
    root, sinks = journal_root
    proc = run_cli(["status", root], env={"COLUMNS": str(columns)})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    too_long = [ln for ln in lines if len(ln) > columns]
    assert not too_long, "\n".join(too_long)
    rows = [ln for ln in lines if re.match(r"\s*[123]\s{3}\S", ln)]
    assert [int(r.split()[0]) for r in rows] == list(STEPS), proc.stdout  # one line per step
    by_step = dict(zip(STEPS, rows, strict=True))
    assert "quarantined" in by_step[2] and "ShardError: is " in by_step[2]
    assert "SinkError" in by_step[1] and "published" in by_step[1]
    if columns >= 132:
        assert all(re.search(r"\d+\.\ds", by_step[s]) for s in (1, 3))  # age and export time shown when wide

    # The full text of every error is below the table; folding may break it anywhere, so compare unspaced.
    tail = proc.stdout[proc.stdout.index("errors:") :]
    doc = _json(root)
    flat = re.sub(r"\s+", "", tail)
    for s in doc["steps"]:
        messages = [s["error_message"]] + [ln["error_message"] for ln in s["lanes"]]
        for message in filter(None, messages):
            assert re.sub(r"\s+", "", message) in flat
    unfolded = proc.stdout.replace("\n", "")
    for sink in sinks:  # every sink is named in full, in its column's header or in a legend line
        assert sink in unfolded


def test_status_json_is_complete(journal_root) -> None:
    root, sinks = journal_root
    doc = _json(root)
    assert doc["sinks"] == sinks
    steps = {s["step"]: s for s in doc["steps"]}
    assert set(steps) == set(STEPS)
    assert steps[2]["state"] == "quarantined" and steps[2]["error_class"] == "ShardError"
    assert str(root / layout.step_dir_name(2)) in steps[2]["error_message"]  # the full message, path and all
    left = []
    for step in (1, 3):
        lanes = {ln["sink"]: ln for ln in steps[step]["lanes"]}
        assert set(lanes) == set(sinks)
        assert lanes[sinks[0]]["state"] == "published"
        assert (lanes[sinks[1]]["state"], lanes[sinks[1]]["next_try"]) == ("failed", None)  # it waits
        left.append(lanes[sinks[1]]["error_class"])
    # the --once run tried the down sink with step 1, then left step 3 for the next start untried
    assert left == ["SinkError", "SinkDownError"]
    assert doc["note"] is None


@pytest.mark.parametrize("what", ["missing", "file", "no journal", "a lock only"])
def test_status_without_a_journal_says_why(tmp_path: Path, what: str) -> None:
    root = tmp_path / "root"
    if what == "file":
        root.write_text("")
    elif what == "no journal":
        root.mkdir()
    elif what == "a lock only":  # a watch that stopped before creating its journal (a full disk)
        (root / layout.STATE_DIR).mkdir(parents=True)
        (root / layout.STATE_DIR / "lock").write_text("")
    proc = run_cli(["status", root])
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("stagerd:")]
    assert len(lines) == 1 and lines[0].startswith("stagerd: JournalError: ")
    expected = {
        "missing": "ROOT does not exist",
        "file": "ROOT is not a directory",
        "no journal": "has not run",
        "a lock only": "no journal yet: ",
    }
    assert expected[what] in lines[0]
    if what == "a lock only":
        assert "has not run" not in lines[0] and "holds only lock" in lines[0], lines[0]
        assert "free space on ROOT's filesystem if it is full" in proc.stderr, proc.stderr


def test_status_where_the_daemon_never_ran_on_a_trainers_checkpoints_says_adopt(tmp_path: Path) -> None:
    """A ROOT of checkpoints a trainer saved itself: started without --adopt, the daemon waits for Stager
    steps that never come, so the hint to start it names --adopt."""
    root = tmp_path / "root"
    (root / "runs").mkdir(parents=True)  # not a checkpoint: not named
    for n in (500, 1000):
        ckpt = root / f"checkpoint-{n}"
        ckpt.mkdir()
        (ckpt / layout.WEIGHTS_NAME).write_bytes(b"")
        (ckpt / "trainer_state.json").write_text("{}")
    proc = run_cli(["status", root])
    assert proc.returncode == 2 and "has not run" in proc.stderr, proc.stderr
    flat = " ".join(proc.stderr.split())
    assert f"`stagerd watch {root} --adopt --sink URL`" in flat, proc.stderr
    assert "saved itself: checkpoint-1000, checkpoint-500;" in flat, proc.stderr

    other = tmp_path / "plain"  # no checkpoint there: the daemon is started as for Stager steps
    other.mkdir()
    plain = " ".join(run_cli(["status", other]).stderr.split())
    assert f"`stagerd watch {other} --sink URL`" in plain and "--adopt" not in plain, plain


def test_status_on_a_read_only_root(journal_root, tmp_path: Path) -> None:
    """A read-only mount of ROOT (a node that only inspects it), with no daemon running: SQLite cannot create
    the -shm file it needs and said 'unable to open database file'."""
    import shutil

    root, _ = journal_root
    copy = tmp_path / "copy"
    shutil.copytree(root / ".stagerd", copy / ".stagerd")
    for suffix in ("-shm", "-wal"):
        (copy / ".stagerd" / f"journal.sqlite{suffix}").unlink(missing_ok=True)
    before = sorted(p.name for p in (copy / ".stagerd").iterdir())
    mnt = tmp_path / "ro"
    mnt.mkdir()
    bind = subprocess.run(["mount", "--bind", str(copy), str(mnt)], capture_output=True, text=True)
    if bind.returncode != 0:
        pytest.skip(f"cannot bind-mount here ({bind.stderr.strip()}); needs CAP_SYS_ADMIN")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(mnt)], check=True)
        proc = run_cli(["status", mnt], env={"COLUMNS": "80"})
        assert proc.returncode == 0, proc.stderr
        assert "unable to open database file" not in proc.stdout + proc.stderr
        # Rich wraps at 80 columns wherever the temp path's length puts the break: compare words only.
        words = " ".join(proc.stdout.split())
        assert "read-only for this user: read from a copy of the journal" in words
        as_json = run_cli(["status", mnt, "--json"])
        doc = json.loads(as_json.stdout)
        assert [s["step"] for s in doc["steps"]] == list(STEPS)

        def states(d: dict[str, Any]) -> list[tuple[int, str, str | None]]:
            return [(s["step"], s["state"], s["error_class"]) for s in d["steps"]]

        assert states(doc) == states(_json(root)) and doc["note"]
        assert sorted(p.name for p in (mnt / ".stagerd").iterdir()) == before
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_a_reader_that_closes_the_output_ends_it_quietly(journal_root) -> None:
    """`stagerd status --json | head -c 10`: the reader goes before the output is written; the command ends
    as one killed by SIGPIPE (141), not with a BrokenPipeError traceback."""
    from tests.cli_helpers import STAGERD, clean_env

    root, _ = journal_root
    proc = subprocess.Popen(
        [*STAGERD, "status", str(root), "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=clean_env(None),
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_four_sinks_fit_80_columns_with_every_lanes_time() -> None:
    """Four sinks' lanes at 80 columns: the fourth's cell was cut to "publi" and the error column lost; now
    each lane's time or tries goes under its state, every cell whole."""
    from rich.console import Console

    from stagerd.cmd.status_table import render

    sinks = ["file:///srv/a", "s3://bucket/run1", "hf://acme/llm", "file:///srv/d"]

    def lane(sink: str, state: str) -> dict[str, Any]:
        failed = state != "published"
        return {
            "sink": sink,
            "state": state,
            "seconds": None if failed else 12.3,
            "attempts": 3,
            "error_class": "SinkError" if failed else None,
            "error_message": "the store answered 500" if failed else None,
            "waiting": None,
        }

    steps = [
        {
            "step": step,
            "state": "published",
            "age_seconds": 100.0,
            "export_seconds": 5.0,
            "export_bytes": 10**9,
            "error_class": None,
            "error_message": None,
            "waiting": None,
            "pinned": False,
            "lanes": [lane(s, "published") for s in sinks],
        }
        for step in (1200, 1300)
    ]
    steps[1]["state"], steps[1]["lanes"][3] = "quarantined", lane(sinks[3], "quarantined")
    disk = {"free": 10**12, "total": 2 * 10**12, "free_percent": 50.0, "low": False}
    doc = {"root": "/scratch/run1", "daemon_pid": None, "holder": None, "sinks": sinks, "disk": disk}
    doc |= {"counts": {"published": 1, "quarantined": 1}, "missed": {}, "steps": steps, "note": None}
    console = Console(width=80, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    render(doc, console)
    lines = console.export_text().splitlines()
    assert not [ln for ln in lines if len(ln.rstrip()) > 80], "\n".join(lines)
    table = "\n".join(lines[lines.index(next(ln for ln in lines if ln.lstrip().startswith("step"))) :])
    assert table.count("12.3s") == 7 and "3x" in table and "quarantined" in table, table
    assert "publi…" not in table and "SinkError: the store answered 500" in table, table
