"""Xet, the Hub's production upload path, end to end: the sink's own bounded hf_xet upload against the Hub
test server's CAS, what a step sends when one file changed, honest byte counts, a CAS that stalls or answers
503.

The real huggingface_hub and hf_xet clients talk to a real HTTP server on 127.0.0.1; nothing is patched.
"""

from __future__ import annotations

import importlib
import time
from pathlib import Path

import pytest
from huggingface_hub import CommitOperationAdd, HfApi, get_hf_file_metadata, hf_hub_url, snapshot_download
from huggingface_hub.utils import get_session

from stagerd.errors import RestoreError, SinkAuthError, SinkError
from stagerd.sinks.hub import step_tag
from stagerd.sinks.hub.upload import LIBRARY_SEAMS, OPERATION_SEAMS
from stagerd.sinks.hub.xet_fetch import xet_download_error
from tests.hubserver import Fault, HubServer
from tests.hubserver.xet_format import Term, XetFormatError, hash_hex, hash_raw, parse_shard
from tests.hubserver.xet_store import merged_fetch_ranges
from tests.sinks.hub.hub_helpers import REPO, export_files, make_sink, write_export

SHORT = 0.5  # seconds: the read and connect timeouts the stall tests give their sink


@pytest.fixture(autouse=True)
def _cold_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_XET_CACHE", str(tmp_path / "xet-cache"))  # this test's sinks start cold


def downloaded(hub: HubServer, revision: str, dest: Path) -> dict[str, bytes]:
    """The repo at `revision`, through hf_xet (reconstruction, then ranged xorb reads)."""
    local = Path(
        snapshot_download(REPO, revision=revision, endpoint=hub.endpoint, token=hub.token, local_dir=dest)
    )
    files = (p for p in local.rglob("*") if p.is_file() and ".cache" not in p.relative_to(local).parts)
    return {p.relative_to(local).as_posix(): p.read_bytes() for p in files}


def holds_export(got: dict[str, bytes], export: Path) -> bool:
    """The downloaded repo is the export, byte for byte, plus the card and `.gitattributes`."""
    want = export_files(export)
    return {k: v for k, v in got.items() if k not in ("README.md", ".gitattributes")} == want


def wire(hub: HubServer) -> int:
    """Xet bytes the server received: xorbs and shards."""
    return hub.stats.xet_bytes["xorb"] + hub.stats.xet_bytes["shard"]


def inline_bytes(hub: HubServer, revision: str) -> int:
    """Bytes of the files at `revision` that live in git itself (sent inline in the commit)."""
    api = HfApi(endpoint=hub.endpoint, token=hub.token)
    entries = api.list_repo_tree(REPO, recursive=True, revision=revision)
    return sum(f.size for f in entries if hasattr(f, "size") and f.lfs is None and f.path != ".gitattributes")


def test_a_step_from_a_fresh_cache_sends_only_the_changed_file_and_the_tag_holds_every_file(
    hub, tmp_path, monkeypatch
):
    export = write_export(tmp_path / "export")
    first = make_sink(hub).publish(export, 1)

    assert not hub.stats.count("POST", r"/info/lfs/") and hub.stats.count("POST", r"/v1/shards$", 200) == 1
    assert first.bytes_uploaded == wire(hub) + inline_bytes(hub, step_tag(1))  # hf_xet's count is the wire
    before, step1 = wire(hub), export_files(export)
    small = export / "model-00002-of-00002.safetensors"
    small.write_bytes(small.read_bytes()[:-64] + bytes(64))  # one tensor's last values change
    monkeypatch.setenv("HF_XET_CACHE", str(tmp_path / "new-pod"))  # a new pod: nothing cached

    second = make_sink(hub).publish(export, 2)

    assert (tmp_path / "new-pod").is_dir()  # the new sink's hf_xet did start cold
    assert hub.stats.commit_adds[-1] == (small.name, "README.md")  # unchanged files are not in the commit
    sent = wire(hub) - before
    assert small.stat().st_size <= sent < small.stat().st_size + 4096, sent  # that file, and a shard
    got = downloaded(hub, step_tag(2), tmp_path / "dl2")
    assert holds_export(got, export)  # every file of the step, also those left out of its commit
    assert second.bytes_uploaded == sent + len(got["README.md"])
    got1 = downloaded(hub, step_tag(1), tmp_path / "dl1")
    assert {k: got1[k] for k in step1} == step1  # the earlier tag still holds the earlier bytes
    assert hub.stats.xet_bytes["read"] > 0 and hub.stats.xet_tokens["read"] >= 1  # downloads took Xet


def test_the_hub_speaks_xet_tokens_tree_and_resolve_headers(hub, tmp_path):
    make_sink(hub).publish(write_export(tmp_path / "export"), 3)
    api = HfApi(endpoint=hub.endpoint, token=hub.token)
    entry = next(
        f for f in api.list_repo_tree(REPO, revision=step_tag(3)) if f.path.startswith("model-00001")
    )
    meta = get_hf_file_metadata(
        hf_hub_url(REPO, entry.path, revision=step_tag(3), endpoint=hub.endpoint), token=hub.token
    )
    assert (
        entry.xet_hash and meta.xet_file_data is not None and meta.xet_file_data.file_hash == entry.xet_hash
    )
    assert meta.xet_file_data.refresh_route.endswith(f"/api/models/{REPO}/xet-read-token/{meta.commit_hash}")

    session, auth = get_session(), {"Authorization": f"Bearer {hub.read_token}"}
    r = session.get(meta.xet_file_data.refresh_route, headers=auth)
    assert r.status_code == 200 and r.json()["casUrl"] == r.headers["X-Xet-Cas-Url"] == hub.cas_url
    assert r.json()["accessToken"] == r.headers["X-Xet-Access-Token"]
    assert int(r.headers["X-Xet-Token-Expiration"]) == r.json()["exp"] > time.time()
    write_url = f"{hub.endpoint}/api/models/{REPO}/xet-write-token/main"
    assert session.get(write_url, headers=auth).status_code == 403  # a read-only Hub token cannot write
    cas = {"Authorization": f"Bearer {r.json()['accessToken']}"}
    assert session.post(f"{hub.cas_url}/v1/shards", headers=cas, content=b"x").status_code == 403
    recon = session.get(f"{hub.cas_url}/v1/reconstructions/{entry.xet_hash}", headers=cas).json()
    assert sum(t["unpacked_length"] for t in recon["terms"]) == entry.size
    tail = session.get(
        f"{hub.cas_url}/v1/reconstructions/{entry.xet_hash}",
        headers={**cas, "Range": f"bytes={entry.size - 10}-{entry.size - 1}"},
    )
    assert tail.status_code == 200 and tail.json()["offset_into_first_range"] > 0


def test_the_cas_protocol_facts():
    words = bytes(range(32))
    assert hash_hex(words) == "07060504030201000f0e0d0c0b0a090817161514131211101f1e1d1c1b1a1918"
    assert hash_raw(hash_hex(words)) == words
    terms = [
        Term("x", 0, 4, 1),
        Term("y", 0, 2, 1),
        Term("x", 4, 6, 1),
        Term("x", 8, 9, 1),
        Term("x", 3, 5, 1),
    ]
    assert merged_fetch_ranges(terms) == {"x": [(0, 6), (8, 9)], "y": [(0, 2)]}
    with pytest.raises(XetFormatError, match="magic"):
        parse_shard(bytes(96))
    with pytest.raises(XetFormatError, match="inside a record"):
        parse_shard(b"HFRepoMetaData" + bytes(20))


def test_the_library_seams_the_sink_uses_are_there():
    for module, name in LIBRARY_SEAMS:
        assert callable(getattr(importlib.import_module(module), name)), f"{module}.{name} moved"
    op = CommitOperationAdd(path_in_repo="a", path_or_fileobj=b"x")
    for field in OPERATION_SEAMS:
        assert hasattr(op, field), f"CommitOperationAdd.{field} moved"


@pytest.mark.parametrize("route", [r"/v1/xorbs/", r"/v1/shards$"], ids=["xorb-upload", "shard-upload"])
def test_a_stalled_cas_fails_the_attempt_as_retryable_in_bounded_time_then_publishes(hub, tmp_path, route):
    export = write_export(tmp_path / "export")
    sink = make_sink(hub, timeout=SHORT, connect_timeout=SHORT, max_attempts=2)
    hub.hang(route, method="POST")

    t0 = time.monotonic()
    with pytest.raises(SinkError) as info:
        sink.publish(export, 4)
    elapsed = time.monotonic() - t0

    assert info.value.retryable and "gave up after 2 attempts" in str(info.value)
    assert "Xet storage did not answer within 1 s" in str(info.value) and hub.token not in str(info.value)
    assert 2 * 2 * SHORT <= elapsed < 12, elapsed  # two attempts, each given up after read + connect
    assert hub.stats.commits[REPO] == 0
    hub.unhang()
    assert not sink.publish(export, 4).skipped
    assert holds_export(downloaded(hub, step_tag(4), tmp_path / "dl"), export)
    # hf_xet's abort only cancels (its tasks end at their next await, a few ms later): what decides is that
    # an abandoned attempt's shard, which maps its files to the xorbs, never lands after it
    assert hub.stats.count("POST", r"/v1/shards$", 200) == 1


def test_a_cas_answering_503_is_retried_by_hf_xet_then_gives_up_as_retryable(hub, tmp_path):
    export = write_export(tmp_path / "export")
    hub.faults.add(Fault("POST", r"/v1/xorbs/", status=503, times=2))
    hub.faults.add(Fault("POST", r"/v1/xorbs/", drop=True, drop_after=100_000))
    make_sink(hub, max_attempts=1, timeout=2).publish(export, 5)  # hf_xet retried: 503, 503, a cut body
    assert hub.stats.count("POST", r"/v1/xorbs/", status=503) == 2 and hub.stats.commits[REPO] == 1

    hub.faults.add(Fault("POST", r"/v1/xorbs/", status=503, times=10_000))
    with pytest.raises(
        SinkError, match=r"gave up after 2 attempts: HTTP 503 from Xet storage on /cas/"
    ) as info:
        make_sink(hub, max_attempts=2, timeout=SHORT).publish(write_export(tmp_path / "next", seed=1), 6)
    assert info.value.retryable and hub.stats.commits[REPO] == 1


def test_restore_names_hf_xet_download_failures():
    # hf_xet's own texts: it retries a chunk it cannot decode, or a CAS 5xx, for its whole retry budget (six
    # minutes by default), then raises these.
    cas = "http://127.0.0.1:1/cas/x/xorbs/default/ab"
    task = "Task error: File reconstruction error: CAS Client Error:"
    cases = [
        (f"{task} Format error: BlockTooBig", RestoreError),
        (f"Request error: HTTP status server error (503 SERVICE UNAVAILABLE), domain: {cas}", SinkError),
        (f"Request error: HTTP status client error (403 FORBIDDEN), domain: {cas}", SinkAuthError),
        # a request its read timeout ended, and a body that stopped mid-way: the wire's, not the data's
        (f"{task} Request middleware error: error sending request for url ({cas})", SinkError),
        (f"{task} Format error: I/O error: error decoding response body", SinkError),
    ]
    for text, kind in cases:
        err = xet_download_error(RuntimeError(text), "hf://acme/llm@step-7/a.safetensors")
        assert type(err) is kind and "a.safetensors" in str(err), (text, err)
    for text, kind in cases:
        assert xet_download_error(RuntimeError(text), "p").retryable is (kind is SinkError), text


def test_a_request_the_server_does_not_serve_fails_the_test():
    hub = HubServer().start()
    assert get_session().get(f"{hub.endpoint}/api/not-a-route").status_code == 404
    with pytest.raises(AssertionError, match="does not serve: \\['GET /api/not-a-route'\\]"):
        hub.stop()


def test_an_upload_abandoned_while_getting_its_token_never_starts_later(hub, tmp_path):
    """The publish gave up while hf_xet still waited for its CAS token; the worker thread it left behind
    got the token later and uploaded, reading through a step handle the daemon had closed since (and
    whose number another step's handle may hold by then)."""
    export = write_export(tmp_path / "export")
    sink = make_sink(hub, timeout=SHORT, connect_timeout=SHORT, max_attempts=1)
    hub.hang(r"/xet-write-token/")
    with pytest.raises(SinkError, match="Xet storage did not answer"):
        sink.publish(export, 4)
    hub.unhang()
    time.sleep(4 * SHORT)  # the token now comes at once: a worker left running would upload meanwhile
    assert hub.stats.count("POST", r"/v1/xorbs/") == 0 and hub.stats.commits[REPO] == 0
