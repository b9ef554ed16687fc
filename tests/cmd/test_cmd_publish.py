"""`stagerd publish`: exit codes and messages, against the local filesystem and a real moto S3."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from stagerd.cli import main
from stagerd.cmd.publish import step_from_path
from stagerd.contract import layout
from tests import s3server
from tests.cli_helpers import run_cli
from tests.s3server import SECRET_KEY, Fault
from tests.sinks.test_sink_fsspec import tree_bytes

s3_server, s3 = s3server.s3_server, s3server.s3  # the fixtures


def make_export(out: Path, seed: int = 0) -> Path:
    """A small real export (publish runs verify's checks first): one safetensors file and its index."""
    rng = np.random.default_rng(seed)
    tensors = {"w": rng.standard_normal((25, 40), dtype=np.float32)}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    index = {"metadata": {"total_size": 4000}, "weight_map": {"w": "model.safetensors"}}
    (out / layout.INDEX_NAME).write_text(json.dumps(index))
    return out


def export_at(root: Path, step: int, seed: int = 0) -> Path:
    return make_export(root / layout.step_dir_name(step) / layout.EXPORT_DIR, seed=seed)


def test_step_from_path(tmp_path):
    assert step_from_path(tmp_path / "step-00000042" / "export") == 42
    assert step_from_path(tmp_path / "step-00000042") is None
    assert step_from_path(tmp_path / "elsewhere" / "export") is None


def test_publish_to_file_then_again_is_a_noop(tmp_path, capsys):
    export = export_at(tmp_path, 42)
    dest = tmp_path / "dest"
    assert main(["publish", str(export), "--sink", f"file://{dest}"]) == 0
    out = capsys.readouterr().out
    assert "published step 42" in out and "2 files" in out
    got = tree_bytes(dest / "step-00000042")
    assert json.loads(got.pop(layout.MANIFEST_NAME))["step"] == 42
    assert got == tree_bytes(export)

    assert main(["publish", str(export), "--sink", f"file://{dest}", "--json"]) == 0
    line = json.loads(capsys.readouterr().out)
    assert line["ok"] and line["skipped"] and line["step"] == 42 and line["bytes_uploaded"] == 0


def test_step_is_required_off_the_staging_layout(tmp_path, capsys):
    export = make_export(tmp_path / "somewhere")
    assert main(["publish", str(export), "--sink", f"file://{tmp_path / 'd'}"]) == 2
    err = capsys.readouterr().err
    assert "ConfigError" in err and "--step N" in err
    assert main(["publish", str(export), "--sink", f"file://{tmp_path / 'd'}", "--step", "7"]) == 0
    assert (tmp_path / "d" / "step-00000007" / layout.MANIFEST_NAME).is_file()


def test_missing_export_dir_and_unknown_scheme_exit_2(tmp_path, capsys):
    assert main(["publish", str(tmp_path / "nope"), "--sink", f"file://{tmp_path}", "--step", "1"]) == 2
    assert "VerifyError" in capsys.readouterr().err
    export = export_at(tmp_path, 1)
    assert main(["publish", str(export), "--sink", "nosuchscheme://x/y"]) == 2
    assert "ConfigError" in capsys.readouterr().err


def test_conflicting_remote_step_exits_2(tmp_path, capsys):
    dest = f"file://{tmp_path / 'dest'}"
    assert main(["publish", str(export_at(tmp_path / "a", 3, seed=1)), "--sink", dest]) == 0
    assert main(["publish", str(export_at(tmp_path / "b", 3, seed=2)), "--sink", dest]) == 2
    assert "SinkConflictError" in capsys.readouterr().err


def test_file_and_s3_sinks_together(s3, tmp_path, capsys):
    export = export_at(tmp_path, 9)
    rc = main(["publish", str(export), "--sink", f"file://{tmp_path / 'dest'}", "--sink", s3.url("runs/a")])
    assert rc == 0
    assert capsys.readouterr().out.count("published step 9") == 2
    assert s3.get("runs/a/step-00000009/model.safetensors") == (export / "model.safetensors").read_bytes()
    assert s3.get("runs/a/latest") == b"step-00000009"


def test_bad_s3_credentials_exit_2_and_spare_the_other_sink(s3, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-5d2a")
    export = export_at(tmp_path, 4)
    rc = main(["publish", str(export), "--sink", s3.url(), "--sink", f"file://{tmp_path / 'dest'}"])
    out, err = capsys.readouterr()
    assert rc == 2
    assert "SinkAuthError" in err and "SignatureDoesNotMatch" in err and s3.url() in err
    assert "not-the-secret-5d2a" not in err + out and SECRET_KEY not in err + out
    assert (tmp_path / "dest" / "step-00000004" / layout.MANIFEST_NAME).is_file()


def test_s3_failing_past_retries_exits_3(s3, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    s3.proxy.add(Fault(ops=("PutObject",), times=100, status=503, code="SlowDown"))
    assert main(["publish", str(export_at(tmp_path, 5)), "--sink", s3.url()]) == 3
    err = capsys.readouterr().err
    assert "SinkError" in err and "SlowDown" in err and "what to do:" in err


def test_the_installed_command_runs(tmp_path):
    export = export_at(tmp_path, 11)
    r = run_cli(["publish", export, "--sink", f"file://{tmp_path / 'd'}"])
    assert r.returncode == 0, r.stderr
    assert "published step 11" in r.stdout
    assert (tmp_path / "d" / "latest").read_text() == "step-00000011"


def test_publish_refuses_what_is_not_a_finished_export(tmp_path, step_dir, capsys):
    """Issue 19, item 5: a truncated file without an index, or a staged step given --step, used to be
    uploaded and committed (and the daemon then refused that step for good as a conflict)."""
    dest = tmp_path / "dest"
    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / "model.safetensors").write_bytes((export_at(tmp_path, 1) / "model.safetensors").read_bytes()[:-9])
    assert main(["publish", str(torn), "--sink", dest.as_uri(), "--step", "5"]) == 2
    assert "VerifyError" in capsys.readouterr().err
    assert main(["publish", str(step_dir), "--sink", dest.as_uri(), "--step", "5"]) == 2
    assert "this is a staged step, not its export" in capsys.readouterr().err
    torn_export = export_at(tmp_path, 2)
    with open(torn_export / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    assert main(["publish", str(torn_export), "--sink", dest.as_uri()]) == 2
    assert "not published:" in capsys.readouterr().err
    assert not dest.exists()


def test_publish_refuses_one_place_twice_or_a_sink_inside_another_as_watch_does(tmp_path, capsys):
    """Before: `publish` checked each URL alone, so a sink given twice (here through a symlink) published the
    step twice into one directory, and one inside another's `raw/` was written among its files."""
    export = export_at(tmp_path / "root", 4)
    dest = tmp_path / "dest"
    dest.mkdir()
    (tmp_path / "alias").symlink_to(dest)
    twice = [dest.as_uri(), (tmp_path / "alias").as_uri()]
    nested = [dest.as_uri(), (dest / "raw" / "inner").as_uri()]
    for sinks, said in [(twice, "are the same place"), (nested, "lies inside sink")]:
        assert main(["publish", str(export), *(a for s in sinks for a in ("--sink", s))]) == 2
        err = capsys.readouterr().err
        assert said in err and repr(sinks[0]) in err and repr(sinks[1]) in err, err
        assert list(dest.iterdir()) == []  # nothing was written


def test_a_sink_that_is_a_staging_root_is_refused_and_named_quoted(tmp_path, capsys):
    """Every sink URL in a message is quoted and has its secrets hidden (`urls.shown`): one form for all."""
    root = tmp_path / "staging"
    (root / ".stagerd").mkdir(parents=True)
    url = root.as_uri()
    assert main(["publish", str(export_at(tmp_path, 1)), "--sink", url]) == 2
    err = capsys.readouterr().err
    assert f"sink {url!r} is the staging ROOT {root}" in err, err
    assert list(root.iterdir()) == [root / ".stagerd"]
