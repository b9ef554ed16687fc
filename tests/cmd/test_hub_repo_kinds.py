"""`hf://datasets/...` and `hf://spaces/...`: the Hub sink publishes to model repos only, so such a URL is
a ConfigError (exit 2) that says so before any request, from every command that takes a sink URL; not a
guess of another model repo, and not a retryable failure of a step (the repo's Hub server, real CLI)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli_helpers import run_cli

# every command, once: the URL forms themselves are parse()'s (tests/sinks/hub/test_repo_type_urls.py)
URLS = ["hf://datasets/acme"]


def _export(d: Path) -> Path:
    from safetensors.torch import save_file

    d.mkdir()
    import torch

    save_file({"w": torch.ones(2)}, str(d / "model.safetensors"))
    return d


@pytest.mark.parametrize("url", URLS)
def test_a_dataset_or_space_url_is_refused_by_name_before_any_request(tmp_path, url):
    from tests.hubserver import HubServer

    export = _export(tmp_path / "export")
    with HubServer() as hub:
        env = {"HF_ENDPOINT": hub.endpoint, "HF_TOKEN": hub.token, "HF_HOME": str(tmp_path / "hf-home")}
        runs = {
            "publish": run_cli(["publish", export, "--sink", url], env=env),
            "watch": run_cli(["watch", tmp_path / "root", "--sink", url, "--once"], env=env),
            "restore": run_cli(["restore", url, tmp_path / "out", "--export"], env=env),
        }
        for command, proc in runs.items():
            assert proc.returncode == 2, (command, proc.stdout + proc.stderr)
            assert "ConfigError" in proc.stderr and "model repos only" in proc.stderr, (command, proc.stderr)
            assert "did you mean" not in proc.stderr, (command, proc.stderr)
        assert hub.stats.requests == []
    assert not (tmp_path / "out").exists()
