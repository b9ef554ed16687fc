"""HubSink when the Hub fails or refuses: 5xx and 429 retried (after `Retry-After`), a server down for a
while, a bad or read-only token an auth error that never shows the token, a permanent failure a
retryable `SinkError` with nothing tagged."""

from __future__ import annotations

import logging

import pytest
from huggingface_hub import HfApi

from stagerd.errors import SinkAuthError, SinkError
from stagerd.sinks.hub import HubSink
from stagerd.sinks.hub.fetch import restore_hub_export
from tests.cli_helpers import run_cli
from tests.hubserver import Fault
from tests.sinks.hub.hub_helpers import REPO, export_files, make_sink, write_export


def test_5xx_and_429_with_retry_after_are_retried(hub, tmp_path):
    export = write_export(tmp_path / "export")
    hub.faults.add(Fault("GET", r"/refs$", status=429, headers={"Retry-After": "1"}))
    hub.faults.add(Fault("POST", r"/commit/", status=500, times=2))
    hub.faults.add(Fault("POST", r"/repos/create", status=502))

    make_sink(hub).publish(export, 11)

    refs_times = hub.stats.times("GET", r"/refs$")
    assert refs_times[1] - refs_times[0] >= 1.0  # waited for Retry-After, not the 0.01 s backoff
    assert hub.stats.count("POST", r"/commit/", status=500) == 2
    assert hub.stats.commits[REPO] == 1
    assert [t.name for t in HfApi(endpoint=hub.endpoint, token=hub.token).list_repo_refs(REPO).tags] == [
        "step-11"
    ]


def test_server_down_then_up(hub, tmp_path):
    export = write_export(tmp_path / "export")
    hub.down_for(0.6)

    result = make_sink(hub, backoff_base=0.2, backoff_max=0.4).publish(export, 13)

    assert not result.skipped and hub.stats.commits[REPO] == 1


def test_bad_token_is_a_clear_auth_error_without_the_token(hub, tmp_path, caplog, capfd):
    export = write_export(tmp_path / "export")
    bad = "hf_" + "Zq9" * 12
    caplog.set_level(logging.DEBUG)

    with pytest.raises(SinkAuthError) as info:
        make_sink(hub, token=bad).publish(export, 14)

    err = info.value
    assert not err.retryable and "401" in str(err) and "hf://acme/llm: step 14" in str(err)
    assert "Invalid credentials" in str(err)
    assert "HF_TOKEN" in err.hint and "?token=" in err.hint and "AWS" not in err.hint, err.hint
    out, errout = capfd.readouterr()
    for text in (str(err), err.hint, repr(err), caplog.text, out, errout):
        assert bad not in text
    assert hub.stats.count("POST", r"/repos/create") == 1  # not retried
    assert REPO not in hub.store.repos


def test_read_only_token_is_an_auth_error(hub, tmp_path):
    HfApi(endpoint=hub.endpoint, token=hub.token).create_repo(REPO, private=True)
    with pytest.raises(SinkAuthError, match="403"):
        make_sink(hub, token=hub.read_token).publish(write_export(tmp_path / "export"), 15)
    assert hub.stats.commits[REPO] == 0


def test_permanent_failure_is_a_sink_error_and_nothing_is_tagged(hub, tmp_path):
    export = write_export(tmp_path / "export")
    before = export_files(export)
    hub.faults.add(Fault("POST", r"/commit/", status=503, times=1000))

    with pytest.raises(SinkError, match=r"step 16: gave up after 3 attempts: HTTP 503 on POST") as info:
        make_sink(hub, max_attempts=3).publish(export, 16)

    assert info.value.retryable
    assert hub.stats.count("POST", r"/commit/") == 3
    assert not make_sink(hub).is_published(16)
    assert export_files(export) == before


def test_token_comes_from_hf_token_and_never_shows_in_the_url(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", hub.token)
    sink = HubSink.from_url(f"hf://{REPO}@main?endpoint={hub.endpoint}&private=false")
    assert sink.url == f"hf://{REPO}@main" and hub.token not in repr(sink)

    sink.publish(write_export(tmp_path / "export"), 17)

    assert not hub.store.repos[REPO].private
    in_query = HubSink.from_url(f"hf://{REPO}?token={hub.token}&endpoint={hub.endpoint}")
    assert in_query.url == f"hf://{REPO}" and hub.token not in repr(in_query)


@pytest.mark.parametrize("offline", ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"])
def test_offline_mode_is_a_config_error_before_any_request_not_a_retried_outage(hub, tmp_path, offline):
    """huggingface_hub reads offline mode once, at import, and then refuses every request: a daemon whose
    environment sets it (often exported for the trainer) would retry each step as a Hub outage forever."""
    make_sink(hub).publish(write_export(tmp_path / "step-00000018" / "export"), 18)
    seen = len(hub.stats.requests)
    env = {"HF_ENDPOINT": hub.endpoint, "HF_TOKEN": hub.token, offline: "1"}

    published = run_cli(["publish", tmp_path / "step-00000018" / "export", "--sink", f"hf://{REPO}"], env=env)
    restored = run_cli(["restore", f"hf://{REPO}", tmp_path / "out", "--export", "--step", "18"], env=env)

    for done in (published, restored):
        text = done.stdout + done.stderr
        assert done.returncode == 2 and "ConfigError" in text and offline in text, text
    assert len(hub.stats.requests) == seen and not (tmp_path / "out").exists()


def test_a_restore_retries_what_the_sink_retries_and_lands_the_step(hub, tmp_path):
    """One 5xx on the refs, the revision or a file's download. Before, the first one ended the restore and
    removed every file it had landed: of a large step's many requests, one failing is to be expected."""
    export = write_export(tmp_path / "export")
    make_sink(hub).publish(export, 19)
    url = f"hf://{REPO}?endpoint={hub.endpoint}&token={hub.token}&backoff_base=0.01&backoff_max=0.05"
    for method, path in [("GET", r"/refs$"), ("GET", r"/revision/"), ("GET", r"/resolve/.*/config.json$")]:
        hub.faults.add(Fault(method, path, status=503))

    out = restore_hub_export(url, tmp_path / "out", 19)

    assert hub.faults.pending == [] and export_files(export).items() <= export_files(out).items()
    hub.faults.add(Fault("GET", r"/resolve/.*/config.json$", status=503, times=100))
    with pytest.raises(SinkError, match=r"config.json: download failed: 503") as info:
        restore_hub_export(f"{url}&max_attempts=3", tmp_path / "again", 19)
    assert info.value.retryable and hub.stats.count("GET", r"/resolve/.*/config.json$", status=503) == 4
    assert not (tmp_path / "again").exists()
