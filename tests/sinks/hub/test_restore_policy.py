"""A restore's requests answered 429 or 5xx, or cut off, go to the URL's own retry policy, never
huggingface_hub's.

huggingface_hub 2.4 retries a tree page itself (`http_backoff`: five more tries, each 429 slept out for its
Retry-After), and `hf_hub_download` sends a file's HEAD seven times when it fails, then resumes a body cut
off up to five times: none of it counted by `max_attempts` or bounded by `max_retry_after`. A restore now
sends no HEAD (the tree listing names each file's size and hash) and one request an attempt.
"""

from __future__ import annotations

import pytest

from stagerd.errors import SinkError
from stagerd.sinks.hub.fetch import restore_hub_export
from tests.hubserver import Fault
from tests.sinks.hub.hub_helpers import REPO, export_files, make_sink, one_file_export

# a page of the refs, the commit's tree, a file kept in git, a file in LFS
ROUTES = [r"/refs$", r"/tree/", r"/resolve/.*/config.json$", r"/resolve/.*/model.safetensors$"]


@pytest.fixture(name="xet")
def lfs_only() -> bool:
    return False  # every file through `/resolve/` (Xet reads are hf_xet's, bounded by test_hang.py)


def published(hub, tmp_path):
    """Step 1 published, by a sink closed after: a live sink's wider timeouts would bound the restore's."""
    export = one_file_export(tmp_path, 1)
    sink = make_sink(hub)
    sink.publish(export, 1)
    sink.close()
    return export


def url_of(hub, **options) -> str:
    query = "&".join(f"{k}={v}" for k, v in {"backoff_base": 0.01, "backoff_max": 0.05, **options}.items())
    return f"hf://{REPO}?endpoint={hub.endpoint}&token={hub.token}&{query}"


@pytest.mark.parametrize("path", ROUTES)
def test_a_retry_after_longer_than_max_retry_after_ends_the_restore_at_once(hub, tmp_path, path):
    published(hub, tmp_path)
    answered = hub.stats.count("GET", path, status=200)
    hub.faults.add(Fault("GET", path, status=429, headers={"Retry-After": "5"}))

    with pytest.raises(SinkError, match="429") as info:
        restore_hub_export(url_of(hub, max_retry_after=1), tmp_path / "out", 1)

    assert info.value.retryable and hub.token not in str(info.value)
    assert hub.stats.count("GET", path, status=429) == 1
    assert hub.stats.count("GET", path, status=200) == answered  # the publish's
    assert hub.stats.count("HEAD", r"/resolve/") == 0
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("path", ROUTES)
def test_each_5xx_answer_is_one_of_the_restores_attempts(hub, tmp_path, path):
    export = published(hub, tmp_path)
    answered = hub.stats.count("GET", path, status=200)
    hub.faults.add(Fault("GET", path, status=503, times=2))

    with pytest.raises(SinkError, match="503"):
        restore_hub_export(url_of(hub, max_attempts=2), tmp_path / "out", 1)

    assert hub.stats.count("GET", path, status=503) == 2
    assert hub.stats.count("GET", path, status=200) == answered
    out = restore_hub_export(url_of(hub, max_attempts=2), tmp_path / "out", 1)  # the Hub answers again
    assert export_files(export).items() <= export_files(out).items()


def test_a_file_cut_off_mid_body_is_resumed_not_sent_again(hub, tmp_path):
    export = published(hub, tmp_path)
    path = r"/resolve/.*/model.safetensors$"
    size = (export / "model.safetensors").stat().st_size
    cut = hub.faults.add(Fault("GET", path, stall_after=size // 3))

    out = restore_hub_export(url_of(hub, timeout=0.5, max_attempts=2), tmp_path / "out", 1)

    assert cut.fired == 1 and export_files(export).items() <= export_files(out).items()
    assert hub.stats.count("GET", path, status=206) == 1  # the next attempt asked for the rest only


def test_a_file_cut_off_again_and_again_comes_whole_while_each_round_brings_it_on(hub, tmp_path, monkeypatch):
    """Every cut was one of the URL's attempts however far it had got: over a link that keeps dropping, a big
    file could not be restored. A round of attempts that brings `_CHUNK` bytes or more of it begins them
    again; one that trickles a few bytes an attempt still ends within them (`test_hang.py`)."""
    from stagerd.sinks.hub import fetch

    export = published(hub, tmp_path)
    path = r"/resolve/.*/model.safetensors$"
    size = (export / "model.safetensors").stat().st_size
    monkeypatch.setattr(fetch, "_CHUNK", size // 8)
    cut = hub.faults.add(Fault("GET", path, stall_after=size // 5, times=4))  # 4 cuts, a fifth each

    out = restore_hub_export(url_of(hub, timeout=0.5, max_attempts=2), tmp_path / "out", 1)

    assert cut.fired == 4 and export_files(export).items() <= export_files(out).items()
    assert hub.stats.count("GET", path, status=206) == 4  # each attempt after the first asked for the rest
