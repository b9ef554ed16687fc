"""A Hub that accepts connections and never answers, or stops mid-answer, and a long commit history.

The Hub-protocol test server (`tests/hubserver/`) hangs for real: it reads the request and holds the
socket open without a byte of answer, or sends the status, the headers and part of the body, then stalls.
The real huggingface_hub client talks to it; nothing is patched.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
from huggingface_hub import HfApi, snapshot_download
from huggingface_hub.utils import get_session

from stagerd.errors import ConfigError, SinkError
from stagerd.sinks.hub import (
    _HISTORY_CAP,
    _HISTORY_PAGE,
    HubSink,
    HubTimeouts,
    commit_message,
    scan_history,
    step_tag,
)
from stagerd.sinks.hub.http_lib import httpx
from tests.cli_helpers import run_cli
from tests.hubserver import HubConfig, HubServer, use_xet
from tests.hubserver.store import Blob
from tests.sinks.hub.hub_helpers import REPO, export_files, make_sink, write_export

CONFIG = HubConfig(multipart_threshold=256 * 1024, multipart_chunk_size=120 * 1024)
SHORT = 0.5  # seconds: the read timeout the hang tests give their sink


@pytest.fixture(autouse=True)
def _xet(monkeypatch):
    use_xet(monkeypatch, True)


@pytest.fixture
def hub_config():
    return CONFIG


def downloaded(hub: HubServer, revision: str, dest: Path) -> dict[str, bytes]:
    local = Path(
        snapshot_download(REPO, revision=revision, endpoint=hub.endpoint, token=hub.token, local_dir=dest)
    )
    return {p.relative_to(local).as_posix(): p.read_bytes() for p in local.rglob("*") if p.is_file()}


# -- timeouts ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stall_after", [None, 16], ids=["no-answer", "stalls-mid-response"])
def test_a_hung_hub_ends_in_a_named_error_in_bounded_time_then_publishes(hub, tmp_path, caplog, stall_after):
    export = write_export(tmp_path / "export")
    sink = make_sink(hub, timeout=SHORT, connect_timeout=SHORT, max_attempts=2)
    caplog.set_level(logging.DEBUG)
    hub.hang(stall_after=stall_after)

    t0 = time.monotonic()
    with pytest.raises(SinkError) as info:
        sink.publish(export, 5)
    elapsed = time.monotonic() - t0

    err = info.value
    assert err.retryable
    assert (
        f"gave up after 2 attempts: the Hub did not answer within {SHORT:g} s (read timeout on POST "
        in str(err)
    )
    assert 2 * SHORT <= elapsed < 10, elapsed  # two attempts, each cut off by the read timeout
    for text in (str(err), repr(err), err.hint or "", caplog.text):
        assert hub.token not in text
    assert hub.stats.commits[REPO] == 0

    hub.unhang()
    result = sink.publish(export, 5)

    assert not result.skipped and hub.stats.commits[REPO] == 1
    assert hub.stats.count("POST", r"/repos/create") == 3  # two hung attempts, then the one answered
    got = downloaded(hub, step_tag(5), tmp_path / "dl")
    assert {k: v for k, v in got.items() if k in export_files(export)} == export_files(export)


@pytest.mark.parametrize(
    ("path", "stall_after"),
    [
        (r"/refs$", None),
        (r"/revision/", None),
        (r"/tree/", None),
        (r"/resolve/.*/config.json$", None),
        (r"/resolve/.*/config.json$", 16),
    ],
    ids=["refs", "revision", "tree-page", "file", "file-stalls-mid-body"],
)
def test_a_restore_from_a_hung_hub_ends_in_a_named_error_then_restores(hub, tmp_path, path, stall_after):
    """A restore has the URL's timeouts and attempts, as the sink. Before, no request of it was bounded: a
    Hub that stalled once left `stagerd restore` (a job's resume) waiting for good; then huggingface_hub
    still tried a tree page six times an attempt, and a file's HEAD seven times (27 s asleep), past
    `max_attempts`. Each attempt is now one request: the hung path sees exactly `max_attempts` of them."""
    export = write_export(tmp_path / "export")
    make_sink(hub).publish(export, 5)
    url = f"hf://{REPO}?timeout={SHORT}&connect_timeout={SHORT}&max_attempts=2&backoff_base=0.01"
    env = {"HF_ENDPOINT": hub.endpoint, "HF_TOKEN": hub.token}
    hung_path = hub.hang(path, stall_after=stall_after)

    hung = run_cli(["restore", url, tmp_path / "hung", "--export", "--step", "5"], env=env, timeout=60)

    assert hung.returncode == 3 and "SinkError" in hung.stderr and hub.token not in hung.stderr, hung.stderr
    assert f"did not answer within {SHORT:g} s" in hung.stderr, hung.stderr
    assert hung_path.fired == 2  # the URL's max_attempts, and no request huggingface_hub retried itself
    assert not (tmp_path / "hung").exists()
    hub.unhang()
    done = run_cli(["restore", url, tmp_path / "out", "--export", "--step", "5"], env=env)
    assert done.returncode == 0, done.stderr
    assert export_files(export).items() <= export_files(tmp_path / "out").items()


@pytest.mark.parametrize(
    ("path", "stall_after"),
    [
        (r"/v1/reconstructions/", None),
        (r"/xorbs/default/", None),
        (r"/xorbs/default/", 16),
        (r"/xet-read-token/", None),
    ],
    ids=["reconstruction", "xorb-range", "xorb-range-stalls-mid-body", "read-token"],
)
def test_a_restore_from_a_stalled_xet_cas_ends_in_a_named_error_then_restores(
    hub, tmp_path, path, stall_after
):
    """hf_hub_download read Xet files on huggingface_hub's own hf_xet session, which none of the URL's
    bounds reached (five minutes a read, six tries a request): a stalled CAS held `stagerd restore` for good.
    The child's time limit is what fails this test if a download is not bounded."""
    export = write_export(tmp_path / "export")
    make_sink(hub).publish(export, 5)
    url = f"hf://{REPO}?timeout={SHORT}&connect_timeout={SHORT}&max_attempts=2"
    env = {"HF_ENDPOINT": hub.endpoint, "HF_TOKEN": hub.token, "HF_XET_CACHE": str(tmp_path / "xet-cache")}
    stall = hub.hang(path, method="GET", stall_after=stall_after)
    big = max(export.glob("*.safetensors"), key=lambda p: p.stat().st_size).name  # the first Xet file read

    hung = run_cli(["restore", url, tmp_path / "hung", "--export", "--step", "5"], env=env, timeout=25)

    assert hung.returncode == 3 and "SinkError" in hung.stderr, hung.stderr
    assert "Xet storage did not answer within 0.5 s, 2 attempts" in hung.stderr, hung.stderr
    assert big in hung.stderr and hub.token not in hung.stderr, hung.stderr
    assert stall.fired == 2  # hf_xet tried it again, as the URL's max_attempts says, then gave up
    assert not (tmp_path / "hung").exists() and [p.name for p in tmp_path.iterdir() if "hung" in p.name] == []
    hub.unhang()
    done = run_cli(["restore", url, tmp_path / "out", "--export", "--step", "5"], env=env)
    assert done.returncode == 0, done.stderr
    assert export_files(export).items() <= export_files(tmp_path / "out").items()


def test_every_request_is_bounded_even_one_that_asks_for_no_timeout(hub):
    sink = make_sink(hub, timeout=SHORT)  # its bound holds for this endpoint while the sink lives
    hub.hang()
    url = f"{hub.endpoint}/api/whoami-v2"
    for asked, bound in ((None, SHORT), (600.0, SHORT), (0.2, 0.2)):
        t0 = time.monotonic()
        with pytest.raises(httpx.ReadTimeout):
            get_session().get(url, timeout=asked)
        assert bound <= time.monotonic() - t0 < bound + 2, asked
    sink.close()  # from now on the endpoint gets the widest bound of the sinks still alive


def test_timeouts_are_url_options_with_defaults():
    assert HubSink.from_url("hf://acme/llm", token="x").timeouts == HubTimeouts(read=60.0, connect=10.0)
    sink = HubSink.from_url("hf://acme/llm?timeout=5&connect_timeout=2.5", token="x")
    assert sink.timeouts == HubTimeouts(read=5.0, connect=2.5)
    for bad in ("timeout=0", "timeout=-1", "connect_timeout=inf", "timeout=soon"):
        with pytest.raises(ConfigError, match="timeout"):
            HubSink.from_url(f"hf://acme/llm?{bad}", token="x")


# -- bounded history walk --------------------------------------------------------------------------------


def grow_history(hub: HubServer, steps: range, *, tag: bool = True) -> None:
    """Commit (and tag) `stagerd: step N` for each step straight into the server's store: a long-lived run."""
    HfApi(endpoint=hub.endpoint, token=hub.token).create_repo(REPO, private=True, exist_ok=True)
    store = hub.store
    with store.lock:
        repo = store.repos[REPO]
        for step in steps:
            head = repo.commits[repo.branches["main"]]
            tree = {**head.tree, "step.txt": Blob.regular(f"{step}\n".encode())}
            c = store.commit(repo, "main", commit_message(step), "", hub.user, tree)
            if tag:
                repo.tags[step_tag(step)] = c.oid


def history_cost_of_one_publish(hub: HubServer, tmp_path: Path, step: int) -> tuple[int, int]:
    """(history requests, commit entries served) by the publish of `step`."""
    requests, served = hub.stats.count("GET", r"/commits/"), hub.stats.commits_served
    make_sink(hub).publish(write_export(tmp_path / f"export-{step}", seed=step), step)
    return hub.stats.count("GET", r"/commits/") - requests, hub.stats.commits_served - served


def test_history_read_per_publish_does_not_grow_with_the_history(tmp_path):
    costs = {}
    for length in (60, 300, 1500):
        with HubServer(config=CONFIG) as hub:
            grow_history(hub, range(1, length + 1))
            costs[length] = history_cost_of_one_publish(hub, tmp_path / str(length), length + 1)
            assert hub.stats.commits[REPO] == 1
            head = hub.store.repos[REPO].commits[hub.store.repos[REPO].branches["main"]]
            assert head.title == commit_message(length + 1)
    assert costs[60] == costs[300] == costs[1500], costs
    requests, served = costs[1500]
    assert requests == 1 and served <= _HISTORY_PAGE  # one page of the main branch, newest first


def test_untagged_commit_below_newer_steps_is_found_and_only_tagged(hub, tmp_path):
    export = write_export(tmp_path / "export", seed=7)
    make_sink(hub, max_attempts=1).publish(export, 7)  # commit + tag, then drop the tag: a crash before it
    del hub.store.repos[REPO].tags[step_tag(7)]
    grow_history(hub, range(8, 8 + 3 * _HISTORY_PAGE // 2))  # newer steps on top: a second page is needed
    received, served = hub.stats.bytes_received, hub.stats.commits_served

    result = make_sink(hub).publish(export, 7)

    assert result.skipped and hub.stats.commits[REPO] == 1 and hub.stats.bytes_received == received
    repo = hub.store.repos[REPO]
    assert repo.commits[repo.tags[step_tag(7)]].title == commit_message(7)
    newer = 3 * _HISTORY_PAGE // 2
    assert newer < hub.stats.commits_served - served <= 2 * _HISTORY_PAGE


def test_history_walk_stops_at_the_cap_among_foreign_commits(tmp_path):
    with HubServer(config=CONFIG) as hub:
        HfApi(endpoint=hub.endpoint, token=hub.token).create_repo(REPO, private=True)
        with hub.store.lock:
            repo = hub.store.repos[REPO]
            tree = dict(repo.commits[repo.branches["main"]].tree)
            for i in range(_HISTORY_CAP + 200):
                hub.store.commit(repo, "main", f"manual edit {i}", "", hub.user, tree)
        requests, served = history_cost_of_one_publish(hub, tmp_path, 1)
        assert served == _HISTORY_CAP and requests == _HISTORY_CAP // _HISTORY_PAGE


def test_scan_history_is_pure():
    commits = [("e", "stagerd: step 9"), ("d", "edit"), ("c", "stagerd: step 7"), ("b", "stagerd: step 5")]
    read = []

    def lazy():
        for c in commits:
            read.append(c[0])
            yield c

    assert scan_history(lazy(), 7)[:2] == (9, "c") and read == ["e", "d", "c"]
    read.clear()
    assert scan_history(lazy(), 6)[:2] == (9, None) and read == ["e", "d", "c", "b"]  # stops at step 5
    read.clear()
    assert scan_history(lazy(), 10)[:2] == (9, None) and read == ["e"]  # the head is an earlier step
    assert scan_history(iter([("x", "edit")] * 5), 3, cap=2) == (None, None, True, False)  # capped
    assert scan_history(iter([("x", "edit")] * 2), 3, cap=2).capped  # the cap reached, whatever follows
    assert scan_history(iter([]), 3) == (None, None, False, False)  # the whole history: not capped
