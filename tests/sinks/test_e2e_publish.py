"""End to end: `stagerd watch ROOT --sink hf://... --sink s3://... --once` publishes every committed step
to both real test servers, and the bytes downloaded back equal the export."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from stagerd.contract import layout
from tests import s3server
from tests.cli_helpers import STAGERD
from tests.daemon_helpers import REPO, clean_env, fast_flags, stage_copy

s3_server, s3 = s3server.s3_server, s3server.s3  # moto behind a fault proxy on 127.0.0.1


def test_watch_once_publishes_every_step_to_hub_and_s3(dcp_mixed, s3, tmp_path: Path) -> None:
    from huggingface_hub import HfApi, hf_hub_download

    from tests.hubserver import HubServer

    src, _ = dcp_mixed
    root = tmp_path / "root"
    steps = [10, 20, 30]
    for step in steps:
        stage_copy(root, step, src, world=4, dtype="bf16")
    with HubServer() as hub:
        env = clean_env(
            dict(
                HF_ENDPOINT=hub.endpoint,
                HF_TOKEN=hub.token,
                HF_HUB_DISABLE_PROGRESS_BARS="1",
                **{k: os.environ[k] for k in os.environ if k.startswith("AWS_")},
            )
        )
        cmd = [*STAGERD, "watch", str(root), "--once", *fast_flags()]
        cmd += ["--sink", "hf://acme/tiny", "--sink", s3.url("runs/tiny")]
        r = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-4000:]
        assert hub.token not in r.stdout + r.stderr

        api = HfApi(endpoint=hub.endpoint, token=hub.token)
        tags = {t.name for t in api.list_repo_refs("acme/tiny").tags}
        assert tags == {f"step-{s}" for s in steps}
        commits = [c.title for c in api.list_repo_commits("acme/tiny")]
        assert sorted(c for c in commits if c.startswith("stagerd:")) == [f"stagerd: step {s}" for s in steps]
        for step in steps:
            export = root / layout.step_dir_name(step) / layout.EXPORT_DIR
            files = sorted(p.name for p in export.iterdir())
            assert "model.safetensors" in files
            for name in files:
                local = (export / name).read_bytes()
                hub_copy = hf_hub_download(
                    "acme/tiny",
                    name,
                    revision=f"step-{step}",
                    endpoint=hub.endpoint,
                    token=hub.token,
                    cache_dir=tmp_path / "hf-cache",
                )
                assert Path(hub_copy).read_bytes() == local, (step, name)
                key = f"runs/tiny/{layout.step_dir_name(step)}/{name}"
                assert s3.get(key) == local, (step, name)
            assert f"runs/tiny/{layout.step_dir_name(step)}/{layout.MANIFEST_NAME}" in s3.keys("runs/tiny/")
        assert s3.get("runs/tiny/latest").decode().strip() == layout.step_dir_name(steps[-1])

        # A second --once publishes nothing new: no commit, no upload.
        before = len(list(api.list_repo_commits("acme/tiny")))
        s3.proxy.reset()
        r = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-4000:]
        assert len(list(api.list_repo_commits("acme/tiny"))) == before
        assert s3.proxy.bytes_in() == 0
