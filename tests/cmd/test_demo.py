"""`stagerd demo` as a user runs it: a subprocess, real gloo training, the daemon, the bit-exact check."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from stagerd.contract import layout
from stagerd.demo.check import check
from stagerd.demo.plan import DemoResult, make_plan
from stagerd.errors import VerifyError
from tests import s3server
from tests.cli_helpers import run_cli
from tests.s3server import SECRET_KEY

s3_server, s3 = s3server.s3_server, s3server.s3  # the fixtures: moto behind a proxy on 127.0.0.1


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    workdir = tmp_path_factory.mktemp("demo") / "my run"  # a space: the default sink is a bare path
    return workdir, run_cli(["demo", "--root", workdir], timeout=240)


@pytest.mark.slow
def test_demo_runs_and_summarises(demo_run) -> None:
    workdir, proc = demo_run
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    out = proc.stdout
    assert re.search(r"3 steps trained, staged, exported, published and checked in \d+\.\d+s", out)
    assert f"staging ROOT    {workdir / 'staging'}" in out
    assert f"sink            {workdir / 'published'}" in out
    rows = re.findall(r"^\s+(\d+)\s+([\d.]+ kB)\s+([\d.]+ kB)\s+.*\bpublished\s+(.+?)\s*$", out, re.M)
    assert [int(r[0]) for r in rows] == [1, 2, 3], out
    assert [r[3] for r in rows] == [str(workdir / "published" / layout.step_dir_name(s)) for s in (1, 2, 3)]
    assert "equals the trained weights bit for bit" in out
    # Off a TTY the progress is plain JSON log lines, not a live bar.
    assert "\x1b[" not in proc.stderr
    assert any(
        json.loads(ln).get("msg", "").startswith("check against the trained weights")
        for ln in proc.stderr.splitlines()
        if ln.startswith("{")
    )


@pytest.mark.slow
def test_demo_output_is_real(demo_run) -> None:
    """What the summary claims is on disk: committed steps, manifests on the sink, a journal."""
    workdir, proc = demo_run
    assert proc.returncode == 0
    staging, published = workdir / "staging", workdir / "published"
    assert [s for s, _ in layout.committed_steps(staging)] == [1, 2, 3]
    for step in (1, 2, 3):
        remote = published / layout.step_dir_name(step)
        manifest = json.loads((remote / layout.MANIFEST_NAME).read_text())
        names = {f["path"] for f in manifest["files"]}
        assert layout.WEIGHTS_NAME in names and "config.json" in names
    status = run_cli(["status", staging, "--json"], timeout=60)
    assert status.returncode == 0
    assert {s["step"]: s["state"] for s in json.loads(status.stdout)["steps"]} == {
        1: "published",
        2: "published",
        3: "published",
    }


@pytest.mark.slow
def test_demo_check_catches_a_flipped_bit(demo_run, tmp_path: Path) -> None:
    """The demo's check is not a formality: one flipped bit in a published tensor fails it."""
    workdir, proc = demo_run
    assert proc.returncode == 0
    plan = make_plan(tmp_path / "copy", None)  # the demo's own check, run on a copy of the run
    shutil.copytree(workdir / "published", plan.published)
    shutil.copytree(workdir / "expected", plan.expected)
    check(plan, DemoResult(plan=plan))  # the copy is intact

    shard = plan.published / layout.step_dir_name(2) / layout.WEIGHTS_NAME
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01  # the last byte belongs to a tensor's data, never to the header
    shard.write_bytes(bytes(data))
    with pytest.raises(VerifyError, match=r"step 2: .* differs from the trained weights"):
        check(plan, DemoResult(plan=plan))


@pytest.mark.slow
def test_demo_publishes_to_s3(s3, tmp_path: Path) -> None:
    """`--sink s3://...`: the steps land in a real S3 endpoint and are checked after downloading them."""
    proc = run_cli(
        ["demo", "--root", tmp_path / "run", "--steps", "2", "--sink", s3.url("demo")], timeout=240
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    keys = s3.keys("demo/")
    for step in (1, 2):
        name = layout.step_dir_name(step)
        assert f"demo/{name}/{layout.MANIFEST_NAME}" in keys
        assert (
            f"{s3.url('demo')}/{name} (downloaded to {tmp_path / 'run' / 'downloaded' / name})" in proc.stdout
        )
    assert s3.get("demo/latest").decode().strip().endswith(layout.step_dir_name(2))
    assert SECRET_KEY not in proc.stdout + proc.stderr


@pytest.mark.slow
def test_demo_publishes_to_the_hub(tmp_path: Path) -> None:
    """`--sink hf://ORG/REPO@REVISION?token=...`: one commit and tag per step on the Hub-protocol test server,
    in a private repo, read back by tag with the URL's token (no HF_TOKEN)."""
    from huggingface_hub import HfApi

    from tests.hubserver import HubServer

    with HubServer() as hub:
        env = {
            "HF_ENDPOINT": hub.endpoint,
            "HF_TOKEN": None,
            "HF_HUB_DISABLE_XET": None,  # Xet, the production upload path, against the server's CAS
            "HF_HOME": str(tmp_path / "hf-home"),
            "HF_HUB_DISABLE_PROGRESS_BARS": None,  # as a user runs it: the demo keeps them off itself
        }
        url = f"hf://acme/demo@run/a?token={hub.token}"
        argv = ["demo", "--root", tmp_path / "run", "--steps", "2", "--sink", url]
        proc = run_cli(argv, env=env, timeout=240)
        assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
        api = HfApi(endpoint=hub.endpoint, token=hub.token)
        assert api.repo_info("acme/demo").private
        tags = {t.name for t in api.list_repo_refs("acme/demo").tags}
        assert {"run/a/step-1", "run/a/step-2"} <= tags
        assert "hf://acme/demo@run/a/step-2 (downloaded to" in proc.stdout
        assert hub.token not in proc.stdout + proc.stderr
        assert "Fetching" not in proc.stderr, proc.stderr[-2000:]  # off a terminal: JSON lines only


def test_demo_refuses_a_used_root(tmp_path: Path) -> None:
    (tmp_path / "staging" / "step-00000001").mkdir(parents=True)
    proc = run_cli(["demo", "--root", tmp_path])
    assert proc.returncode == 2
    assert "already holds a demo run" in proc.stderr
    assert "what to do: pass a new --root" in proc.stderr


def test_demo_help() -> None:
    proc = run_cli(["demo", "--help"])
    assert proc.returncode == 0
    assert "--root DIR" in proc.stdout and "--sink URL" in proc.stdout
