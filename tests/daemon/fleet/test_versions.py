"""Nodes of two stagerd builds in one fleet step, as during a rolling upgrade. A leader of an older build
than its followers used to leave each follower waiting for a record it never writes until the fleet wait
ended (`FleetWaitError`, 10 minutes by default), saying only which node it waited for. Now each node's
claim names its build's fleet protocol (`daemon/fleet/version.py`), and a node that sees another speak
another one, or none (a build from before protocol versions), says so at once by name, both ways round,
before anything is claimed or written on a sink; the step is left waiting, never quarantined, and once the
old node is upgraded and restarted it is exported as if nothing had happened.

The older node is what it writes: its claim and its raw part on the exchange, byte for byte as that build
writes them (`fleet_helpers.older_node`); the newer nodes are real daemons (`stagerd watch --once`) on the
S3 test server, or `FleetNode` threads."""

from __future__ import annotations

import json
import time

import pytest

from stagerd import __version__
from stagerd.contract import layout
from stagerd.contract.root_id import root_id
from stagerd.daemon.fleet.exchange import StepExchange
from stagerd.daemon.fleet.records import settings_of
from stagerd.daemon.fleet.version import PROTOCOL
from stagerd.daemon.journal import Journal
from stagerd.errors import FleetVersionError, SinkError
from stagerd.sinks.claims import claim_key
from stagerd.sinks.fetch import RemoteStore
from stagerd.sinks.fsspec import FsspecSink
from tests.daemon.fleet.test_daemon import _done, _published_states, _single, _watch
from tests.daemon.fleet.test_protocol import SHARD, STEP, _keys, _node, _stage, _tree
from tests.fleet_helpers import older_node
from tests.s3server import s3, s3_server  # noqa: F401  (fixtures)

NAME = layout.step_dir_name(STEP)
OLD = "a stagerd from before fleet protocol versions (protocol 1)"
NEW = f"stagerd {__version__} (fleet protocol {PROTOCOL})"
WAIT = ("--fleet-wait-seconds", "60")  # a wait, where a node should have said what is wrong, ends in a minute


def _settings(url: str) -> dict:
    """The claim's settings of a daemon run as `_watch` runs it, publishing to `url`."""
    return settings_of([FsspecSink.from_url(url)], None, None, SHARD, None, False)


def _fleet_keys(env) -> list[str]:
    """What the fleet wrote where a reader looks for the step: its files, its claim, its `latest`."""
    sink = [f"fleet/{NAME}/", f"fleet/{claim_key(NAME)}", "fleet/latest"]
    return [k for k in _keys(env) if any(k.startswith(s) for s in sink)]


def _claim_names_protocol(env, node: int, p) -> bool:
    key = f"fleet/fleet/{NAME}/node-{node:05d}.json"
    return key in _keys(env) and json.loads(env.get(key)).get("protocol") == PROTOCOL and p.poll() is None


@pytest.mark.parametrize("older", [1, 0], ids=["older-follower", "older-leader"])
def test_a_node_of_an_older_stagerd_is_named_at_once_and_the_step_exports_once_it_is_upgraded(
    tmp_path,
    dcp_mixed2,
    s3,  # noqa: F811
    older,
):
    shared, node_dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    single = _single(shared, s3)
    url, newer = s3.url("fleet"), 1 - older
    old_root, new_root = node_dirs[older].parent, node_dirs[newer].parent
    (old_root / layout.STATE_DIR).mkdir()  # a daemon's ROOT, as the older build ran on it: its identity
    older_node(node_dirs[older], url, root_id(old_root), _settings(url))  # claim and raw part, then it waits

    # a wait of the setting would end as FleetWaitError, not as the version's error
    rc, log = _done(_watch(new_root, url, *WAIT))
    line = [ln for ln in log.splitlines() if ln.startswith(f"  step {STEP}: ")]
    assert rc == 1 and len(line) == 1, log
    assert "still waiting (not quarantined): FleetVersionError: " in line[0], log
    assert f"node {older} runs {OLD}, node {newer} runs {NEW}" in line[0], log
    assert f"node {older} runs the older build" in line[0] and FleetVersionError.hint in line[0], log
    j = Journal.open_readonly(new_root)
    try:
        (row,) = j.steps()
    finally:
        j.close()
    assert (row.state, row.error_class, row.next_try) == ("failed", "FleetVersionError", None)
    assert _fleet_keys(s3) == []  # nothing claimed or written on the sink: not even partially published

    # the older node, waiting for the leader's claim (a follower) or its owners' files (the leader), reads
    # the others' failures of its sink as that build does: it stops too, naming the newer node's error
    sink, store = FsspecSink.from_url(url), RemoteStore.open(url)
    try:
        x = StepExchange(sink, store, STEP, older, 2, 60, 0.05, lambda s, n: None)
        seen = x.failure_of(sink, [newer])
    finally:
        store.close()
        sink.close()
    assert isinstance(seen, SinkError) and f"node {newer} could not publish" in str(seen), seen
    assert "(FleetVersionError: " in str(seen) and f"node {older} runs {OLD}" in str(seen), seen

    # the rolling upgrade finished: the old node restarts on this build and rewrites its claim
    daemons = [_watch(old_root, url, *WAIT)]
    try:
        deadline = time.monotonic() + 60
        while not _claim_names_protocol(s3, older, daemons[0]) and daemons[0].poll() is None:
            assert time.monotonic() < deadline, "the upgraded node never rewrote its claim"
            time.sleep(0.1)
        daemons.append(_watch(new_root, url, *WAIT))
        (rc_u, log_u), (rc_a, log_a) = (_done(p) for p in daemons)
    finally:
        for p in daemons:  # a failed assert leaves none behind
            if p.poll() is None:
                p.kill()
                p.wait()
    assert (rc_u, rc_a) == (0, 0), log_u + log_a
    assert _tree(_keys(s3), s3, "fleet") == single
    assert s3.get("fleet/latest") == NAME.encode()
    assert _published_states(old_root) == _published_states(new_root) == ["published"]


def test_a_node_of_a_newer_stagerd_says_this_node_is_the_one_to_upgrade(tmp_path, dcp_mixed2):
    """Node 1 runs a build newer than this one (its claim names a later protocol): node 0 is the older
    build and says so, naming both; nothing of the fleet reaches the sink."""
    _, node_dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    url = (tmp_path / "sink").as_uri()
    future = {**_settings(url), "protocol": PROTOCOL + 1, "stagerd": "99.0.0"}
    older_node(node_dirs[1], url, str(node_dirs[1].parent), future)
    node, seen = _node(node_dirs[0], url)
    with pytest.raises(FleetVersionError) as e:
        node.run()
    assert str(e.value).endswith(
        f"step {STEP}: node 1 runs stagerd 99.0.0 (fleet protocol {PROTOCOL + 1}), node 0 runs {NEW}: every "
        "node of a step must speak one fleet protocol; node 0 runs the older build"
    )
    assert e.value.retryable
    assert any("waiting for node 1 to run this node's fleet protocol" in s for s in seen), seen
    sink = tmp_path / "sink"
    assert not (sink / NAME).exists() and not (sink / claim_key(NAME)).exists()
