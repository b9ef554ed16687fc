"""A Hub sink's requests answered 429 or 5xx, left unanswered or dropped go to the sink's own retry policy,
never huggingface_hub's.

huggingface_hub 2.4 retries such a request itself inside a tree page, a history page and the upload modes
(`http_backoff`: five more tries, each 429 slept out for its Retry-After, the rest after 1 to 8 s). Before,
a publish whose `max_retry_after` is 1 s slept through the Hub's Retry-After five times before the sink saw
the 429, `max_attempts=1` sent six requests, and one attempt at a tree page that the Hub left unanswered
took six read timeouts and 23 s of sleep. The same client outside a sink still retries as huggingface_hub
does.
"""

from __future__ import annotations

import pytest
from huggingface_hub import HfApi

from stagerd.errors import SinkError
from tests.hubserver import Fault
from tests.sinks.hub.hub_helpers import REPO, make_sink, one_file_export

# a tree page of the parent commit, a page of the branch's history, the upload modes
ROUTES = [("GET", r"/tree/"), ("GET", r"/commits/main"), ("POST", r"/preupload/")]


@pytest.fixture(name="xet")
def lfs_only() -> bool:
    return False  # the requests at issue are the Hub API's, the same on either upload path


@pytest.mark.parametrize(("method", "path"), ROUTES)
def test_a_retry_after_longer_than_max_retry_after_ends_the_publish_at_once(hub, tmp_path, method, path):
    export = one_file_export(tmp_path, 1)
    sink = make_sink(hub, max_retry_after=1)
    hub.faults.add(Fault(method, path, status=429, headers={"Retry-After": "5"}))

    with pytest.raises(SinkError, match="rate limited for 5 s") as info:
        sink.publish(export, 1)

    assert info.value.retryable
    assert hub.stats.count(method, path, status=429) == 1 and hub.stats.count(method, path, status=200) == 0
    assert hub.stats.commits[REPO] == 0
    assert not sink.publish(export, 1).skipped  # the Hub answers again: the daemon's next try lands it


@pytest.mark.parametrize(("method", "path"), ROUTES)
def test_each_5xx_answer_is_one_of_the_sinks_attempts(hub, tmp_path, method, path):
    export = one_file_export(tmp_path, 1)
    hub.faults.add(Fault(method, path, status=503, times=2))

    with pytest.raises(SinkError, match="gave up after 2 attempts: HTTP 503"):
        make_sink(hub, max_attempts=2).publish(export, 1)

    assert hub.stats.count(method, path, status=503) == 2 and hub.stats.count(method, path, status=200) == 0
    assert hub.stats.commits[REPO] == 0


def test_an_unanswered_request_is_one_attempt(hub, tmp_path):
    export = one_file_export(tmp_path, 1)
    hung = hub.hang(r"/tree/")

    with pytest.raises(SinkError, match=r"gave up after 1 attempts: the Hub did not answer within 0\.5 s"):
        make_sink(hub, timeout=0.5, connect_timeout=0.5, max_attempts=1).publish(export, 1)

    hub.unhang()
    assert not make_sink(hub).publish(export, 1).skipped
    assert hung.fired == 1  # the tree requests that reached the hung Hub


def test_a_dropped_connection_is_one_attempt(hub, tmp_path):
    export = one_file_export(tmp_path, 1)
    hub.faults.add(Fault("GET", r"/commits/main", drop=True))

    with pytest.raises(SinkError, match="gave up after 1 attempts: connection failed"):
        make_sink(hub, max_attempts=1).publish(export, 1)

    assert hub.stats.commits[REPO] == 0
    assert not make_sink(hub).publish(export, 1).skipped


@pytest.mark.parametrize("path", [r"^/_lfs/part/", r"/info/lfs/objects/batch$"])
def test_the_lfs_transfer_keeps_huggingface_hubs_retries(hub, tmp_path, path):
    """Only the Hub API's requests (`/api/...`) are the sink's to retry: a part of a multipart LFS upload
    answered 503 is sent again by huggingface_hub, not the whole file by the sink's next attempt."""
    export = one_file_export(tmp_path, 1)  # one LFS file, in three parts: uploaded in the calling thread
    method = "PUT" if "part" in path else "POST"
    hub.faults.add(Fault(method, path, status=503, skip=1 if "part" in path else 0))

    result = make_sink(hub, max_attempts=1).publish(export, 1)

    assert not result.skipped and hub.stats.count(method, path, status=503) == 1
    assert hub.stats.count("PUT", r"^/_lfs/part/", status=200) == 3  # each part once


def test_outside_a_sink_huggingface_hub_still_retries_itself(hub, tmp_path):
    make_sink(hub).publish(one_file_export(tmp_path, 1), 1)  # the sink's hooks are on the shared client
    # the upload modes: huggingface_hub 1.x and 2.x both retry them (1.x lists a tree's first page once)
    hub.faults.add(Fault("POST", r"/preupload/", status=503))
    api = HfApi(endpoint=hub.endpoint, token=hub.token)

    api.upload_file(path_or_fileobj=b"notes\n", path_in_repo="notes.txt", repo_id=REPO)

    assert "notes.txt" in [f.path for f in api.list_repo_tree(REPO)]
    assert hub.stats.count("POST", r"/preupload/", status=503) == 1
