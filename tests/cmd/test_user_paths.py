"""Mistakes a new user makes with the documented commands, each found by running them as the README says:
the error names the right command and the next step, and a refused command leaves nothing behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from stagerd.cli import main
from tests.cli_helpers import run_cli
from tests.cmd.restore_helpers import run_restore, tree
from tests.daemon_helpers import fast_flags, stage_copy, truncate_a_shard
from tests.s3server import s3, s3_server  # noqa: F401  (fixtures)


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["restore", "file:///srv/none", "ROOT", "--step", "two"], "restore"),
        (["consolidate", "SRC", "OUT", "--threads", "0"], "consolidate"),
        (["prune", "file:///srv/none", "--keep-last", "0"], "prune"),
    ],
)
def test_a_config_error_sends_to_the_help_of_the_command_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], command: str
) -> None:
    argv = [str(tmp_path / a) if a in ("ROOT", "SRC", "OUT") else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "stagerd: ConfigError: " in err, err
    assert f"what to do: see `stagerd {command} --help`" in err and "watch" not in err, err


def test_a_restore_without_credentials_asks_for_s3_credentials(s3, tmp_path: Path) -> None:  # noqa: F811
    env = {"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None}  # the fixture's files are absent
    r = run_restore(f"s3://{s3.bucket}/run", tmp_path / "root", env=env)
    assert r.returncode == 2 and "SinkAuthError" in r.stderr, r.stderr
    hint = r.stderr.split("what to do: ", 1)[1]
    assert "AWS_ACCESS_KEY_ID" in hint and "HF_TOKEN" not in hint, r.stderr  # only an s3:// URL's own
    assert not (tmp_path / "root").exists()


def test_a_failed_restore_leaves_no_new_directory(tmp_path: Path) -> None:
    sink = tmp_path / "sink"
    sink.mkdir()
    for args in ([], ["--step", "7"]):
        r = run_restore(sink.as_uri(), tmp_path / "new-root", *args)
        assert r.returncode == 2 and "RestoreError" in r.stderr, r.stderr
        assert not (tmp_path / "new-root").exists()  # was left with .stagerd/lock
    r = run_restore(sink.as_uri(), tmp_path / "a" / "b" / "eval", "--export", "--step", "7")
    assert r.returncode == 2 and "RestoreError" in r.stderr, r.stderr
    assert not (tmp_path / "a").exists()
    existing = tmp_path / "existing-root"
    existing.mkdir()
    assert run_restore(sink.as_uri(), existing).returncode == 2
    assert existing.is_dir()  # a ROOT the user had is never removed


@pytest.fixture
def staged(tmp_path: Path, dcp_mixed2) -> tuple[Path, Path]:
    """A staging ROOT with one committed step, and a finished export of it outside ROOT."""
    root = tmp_path / "root"
    step_dir = stage_copy(root, 3, dcp_mixed2[0], 2)
    export = tmp_path / "hf-3"
    r = run_cli(["consolidate", step_dir, export])
    assert r.returncode == 0, r.stderr
    return root, export


def test_publish_refuses_a_local_sink_among_the_staged_steps(staged: tuple[Path, Path]) -> None:
    root, export = staged
    before = tree(root)
    names = sorted(p.name for p in root.iterdir())
    for sink in (root, root / "step-00000009", root / "step-00000003" / "copy", root / ".stagerd" / "x"):
        r = run_cli(["publish", export, "--step", "9", "--sink", sink.as_uri()])
        assert r.returncode == 2 and "stagerd: ConfigError: sink " in r.stderr, r.stderr
        assert "staging ROOT" in r.stderr and "Traceback" not in r.stderr
    assert tree(root) == before and sorted(p.name for p in root.iterdir()) == names
    # a directory of its own beside the steps is allowed, as `watch` allows it
    r = run_cli(["publish", export, "--step", "9", "--sink", (root / "exports").as_uri()])
    assert r.returncode == 0, r.stderr
    assert (root / "exports" / "step-00000009" / "stagerd.manifest.json").is_file()


def test_consolidate_and_verify_name_a_root_given_for_a_step(
    staged: tuple[Path, Path], tmp_path: Path
) -> None:
    root, export = staged
    r = run_cli(["consolidate", root, tmp_path / "out"])
    assert r.returncode == 2, r.stderr
    assert "SRC is a staging ROOT, not a step" in r.stderr and str(root / "step-00000003") in r.stderr
    assert "delete" not in r.stderr  # the old hint said to delete the "step"
    r = run_cli(["verify", export, "--against", root])
    assert r.returncode == 2 and "--against is a staging ROOT" in r.stderr, r.stderr
    r = run_cli(["consolidate", export, tmp_path / "out"])
    assert r.returncode == 2 and "already a Hugging Face export" in r.stderr, r.stderr
    assert "delete" not in r.stderr and not (tmp_path / "out").exists()


def test_a_quarantined_step_points_to_retry_in_watch_and_status(tmp_path: Path, dcp_mixed2) -> None:
    root, sink, other = tmp_path / "root", tmp_path / "sink", tmp_path / "other"
    stage_copy(root, 1, dcp_mixed2[0], 2)
    truncate_a_shard(stage_copy(root, 2, dcp_mixed2[0], 2))
    argv = ["watch", root, "--once", "--max-attempts", "1", *fast_flags()]
    r = run_cli([*argv, "--sink", sink.as_uri()])
    assert r.returncode == 1, r.stdout + r.stderr
    assert "what to do: a quarantined step is never tried again by itself" in r.stdout, r.stdout
    assert "(hint: the staged step is incomplete; re-save it" in r.stdout, r.stdout
    assert f"then `stagerd retry {root}`" in r.stdout
    # run again, as after fixing a token: the start says why nothing is tried
    r = run_cli([*argv, "--sink", sink.as_uri()])
    assert r.returncode == 1
    assert "1 step(s) quarantined in the journal (2)" in r.stderr, r.stderr
    r = run_cli(["status", root], env={"COLUMNS": "200"})
    assert r.returncode == 0 and f"then `stagerd retry {root}`" in r.stdout, r.stdout
    # a sink left out of the last run is marked so, not shown as one the daemon still works on
    r = run_cli([*argv, "--sink", other.as_uri()])
    r = run_cli(["status", root], env={"COLUMNS": "200"})
    assert f"{sink.as_uri()}  (no longer a --sink" in r.stdout, r.stdout
    assert f"{other.as_uri()}  (no longer" not in r.stdout
    retried = run_cli(["retry", root])
    assert retried.returncode == 0
    r = run_cli(["status", root], env={"COLUMNS": "200"})
    assert "what to do" not in r.stdout, r.stdout  # nothing quarantined now: no advice


def test_a_sink_dropped_from_the_command_leaves_no_advice_in_the_summary(tmp_path: Path, dcp_mixed2) -> None:
    """A sink that held a step quarantined (another upload there), then left out of the command line: the next
    `--once` run publishes everywhere it is asked to, and neither its start nor its summary says anything of
    that old lane; given again, the sink's lane is warned of at the start."""
    root, bad, good = tmp_path / "root", tmp_path / "bad", tmp_path / "good"
    stage_copy(root, 1, dcp_mixed2[0], 2)
    (bad / "step-00000001").mkdir(parents=True)
    (bad / "step-00000001" / "stagerd.manifest.json").write_text('{"format": "another"}')
    argv = ["watch", root, "--once", *fast_flags()]
    r = run_cli([*argv, "--sink", bad.as_uri()])
    assert r.returncode == 1 and "SinkConflictError" in r.stdout and "what to do" in r.stdout, r.stdout
    r = run_cli([*argv, "--sink", good.as_uri()])
    assert r.returncode == 0 and "1 step(s) published, 0 not" in r.stdout, r.stdout + r.stderr[-2000:]
    assert "what to do" not in r.stdout, r.stdout
    assert "quarantined in the journal" not in r.stderr, r.stderr  # nor does the start warn of it
    r = run_cli([*argv, "--sink", good.as_uri(), "--sink", bad.as_uri()])  # back on the command line
    assert "1 step(s) quarantined in the journal (1)" in r.stderr, r.stderr


def test_a_step_the_hub_repo_lacks_is_named_as_such(tmp_path: Path) -> None:
    from tests.hubserver import HubConfig, HubServer
    from tests.sinks.hub.hub_helpers import REPO, make_sink, write_export

    with HubServer(config=HubConfig()) as hub:
        make_sink(hub).publish(write_export(tmp_path / "export"), 7)
        url = f"hf://{REPO}?endpoint={hub.endpoint}"
        r = run_restore(url, tmp_path / "eval", "--export", "--step", "9", env={"HF_TOKEN": hub.token})
        # a repo nothing was published to: before, the hint spoke only of a private repo and its token
        gone = url.replace(REPO, f"{REPO}-never")
        never = run_restore(gone, tmp_path / "eval", "--export", env={"HF_TOKEN": hub.token})
    assert r.returncode == 2, r.stderr
    assert "has no revision step-9: that step was never published" in r.stderr, r.stderr
    assert "private repo" not in r.stderr and not (tmp_path / "eval").exists()
    assert never.returncode == 2 and "no such repo" in never.stderr, never.stderr
    assert "check the repo's name" in never.stderr, never.stderr


def test_consolidate_of_a_step_not_yet_committed_says_so(staged: tuple[Path, Path], tmp_path: Path) -> None:
    import shutil

    root, _ = staged
    unmarked = tmp_path / "copy" / "step-00000003"
    shutil.copytree(root / "step-00000003", unmarked)
    (unmarked / "stagerd.commit.json").unlink()
    r = run_cli(["consolidate", unmarked, tmp_path / "out"])
    assert r.returncode == 0, r.stderr
    assert "the step is not committed" in r.stderr, r.stderr
    r = run_cli(["consolidate", root / "step-00000003", tmp_path / "out2"])
    assert r.returncode == 0 and "not committed" not in r.stderr, r.stderr


def test_verify_checks_a_published_copy_against_its_manifest(
    staged: tuple[Path, Path], tmp_path: Path
) -> None:
    _, export = staged
    sink = tmp_path / "sink"
    assert run_cli(["publish", export, "--step", "3", "--sink", sink.as_uri()]).returncode == 0
    copy = sink / "step-00000003"
    r = run_cli(["verify", copy])
    assert r.returncode == 0 and "sha256 as stagerd.manifest.json lists" in r.stdout, r.stdout + r.stderr
    weights = max(copy.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF  # inside a tensor: the headers and index still agree
    weights.write_bytes(bytes(data))
    r = run_cli(["verify", copy])
    assert r.returncode == 2 and "sha256 differs from the manifest" in r.stderr, r.stdout + r.stderr
    assert weights.name in r.stderr and "stagerd restore" in r.stderr
    # the sink's URL itself, as a user tries next: named as a URL, with the command that downloads it
    r = run_cli(["verify", f"{sink.as_uri()}/step-00000003"])
    assert r.returncode == 2 and "EXPORT_DIR is a URL" in r.stderr, r.stderr
    assert f"{sink.as_uri()}/step-00000003" in r.stderr and "stagerd restore URL OUT --export" in r.stderr


def test_watch_names_a_trainers_own_checkpoints_without_adopt(
    staged: tuple[Path, Path], tmp_path: Path
) -> None:
    root = tmp_path / "outputs"
    (root / "checkpoint-500" / "pytorch_model_fsdp_0").mkdir(parents=True)
    (root / "checkpoint-500" / "pytorch_model_fsdp_0" / ".metadata").write_bytes(b"not read")
    (root / "checkpoint-500" / "trainer_state.json").write_text("{}")
    argv = ["watch", root, "--once", "--sink", (tmp_path / "sink").as_uri(), *fast_flags()]
    r = run_cli(argv)
    assert r.returncode == 0 and "0 step(s) published" in r.stdout, r.stdout + r.stderr
    assert "holds checkpoints a trainer saved itself (checkpoint-500)" in r.stderr, r.stderr
    assert "--adopt" in r.stderr
    stager_root, _ = staged  # steps saved through the Stager: nothing to say
    r = run_cli(["watch", stager_root, "--once", "--sink", (tmp_path / "sink2").as_uri(), *fast_flags()])
    assert r.returncode == 0 and "trainer saved itself" not in r.stderr, r.stderr


def test_status_keeps_raw_lanes_of_a_configured_sink(staged: tuple[Path, Path], tmp_path: Path) -> None:
    root, _ = staged
    sink = (tmp_path / "sink").as_uri()
    r = run_cli(["watch", root, "--once", "--publish-raw", "--sink", sink, *fast_flags()])
    assert r.returncode == 0, r.stdout + r.stderr
    r = run_cli(["status", root], env={"COLUMNS": "200"})
    assert f"raw:{sink}" in r.stdout and "no longer" not in r.stdout, r.stdout


def test_a_root_a_restore_holds_is_named_so_not_watched(staged: tuple[Path, Path], tmp_path: Path) -> None:
    import subprocess

    from tests.cli_helpers import STAGERD, clean_env

    root, _ = staged
    sink = (tmp_path / "sink").as_uri()
    assert run_cli(["watch", root, "--once", "--publish-raw", "--sink", sink, *fast_flags()]).returncode == 0
    target, go_on, other = tmp_path / "target", tmp_path / "go-on", (tmp_path / "other").as_uri()
    target.mkdir()
    assert run_cli(["watch", target, "--once", "--sink", other, *fast_flags()]).returncode == 0  # a journal
    env = clean_env({"STAGERD_DELAY_AT": "restore.landing:60", "STAGERD_DELAY_RELEASE": str(go_on)})
    restore = subprocess.Popen(
        [*STAGERD, "restore", sink, str(target)], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        while "delay point restore.landing" not in (line := restore.stderr.readline()):
            assert line or restore.poll() is None, "the restore ended before its delay point"
        r = run_cli(["watch", target, "--once", "--sink", other, *fast_flags()])
        assert r.returncode == 2 and "held by a running `stagerd restore`" in r.stderr, r.stderr
        assert "wait for the restore to end" in r.stderr and "watched" not in r.stderr
        r = run_cli(["status", target], env={"COLUMNS": "200"})
        assert "daemon not running; a `stagerd restore` holds ROOT" in r.stdout, r.stdout
    finally:
        go_on.touch()
        assert restore.wait(60) == 0, restore.stderr.read()


def test_a_restore_from_a_store_that_does_not_answer_says_to_run_it_again(tmp_path: Path) -> None:
    """The daemon's advice ("stagerd retries with backoff") is wrong for a restore, which has given up."""
    env = {
        "AWS_ACCESS_KEY_ID": "x",
        "AWS_SECRET_ACCESS_KEY": "y",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL_S3": "http://127.0.0.1:9",  # the discard port: nothing listens
        "AWS_MAX_ATTEMPTS": "1",
    }
    r = run_restore("s3://bucket/run", tmp_path / "root", env=env)
    assert r.returncode == 3 and "SinkError" in r.stderr, r.stderr
    hint = r.stderr.split("what to do: ", 1)[1]
    assert "run the restore again" in hint and "retries with backoff" not in hint, r.stderr
    assert not (tmp_path / "root").exists()
