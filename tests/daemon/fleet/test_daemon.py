"""Issue 14 through the daemon: one `stagerd watch ROOT_k --sink s3://... --once` per node, node-local
ROOTs, no shared filesystem; the S3 export equals the single-daemon export of the same step from a shared
ROOT, byte for byte (N = 2 and 3, a node started late, a second sink, a Hub sink), a SIGKILL at each fleet
crash point is completed exactly once by a restart, and a wait for a missing node shows in `stagerd
status`, `/healthz` and the metrics while it lasts and never ends in a quarantine."""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from pathlib import Path

import pytest

from stagerd.contract import layout
from stagerd.daemon.journal import Journal
from stagerd.errors import FleetWaitError, JournalError
from stagerd.ops.crashpoints import ENV
from tests.cli_helpers import run_cli, start_cli
from tests.daemon.fleet.test_protocol import SHARD, STEP, _keys, _stage, _tree
from tests.daemon_helpers import fast_flags
from tests.s3server import s3, s3_server  # noqa: F401  (fixtures)


def _watch(root: Path, url: str, *args: str, env: dict | None = None) -> subprocess.Popen[str]:
    return start_cli(
        [
            "watch",
            root,
            "--sink",
            url,
            "--once",
            "--max-shard-size",
            str(SHARD),
            "--max-attempts",
            "2",
            *fast_flags(),
            *args,
        ],
        env=env,
    )


def _done(p: subprocess.Popen[str], timeout: float = 120) -> tuple[int, str]:
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out + err


# The single-daemon export of each staged input, once per test process: a reference the fleet's export is
# compared with, which the same input always exports the same (the created time aside, as nodes share it).
_SINGLE: dict[str, dict[str, bytes]] = {}


def _staged_input(shared: Path) -> str:
    digest = hashlib.sha256()
    for p in sorted(q for q in shared.rglob("*") if q.is_file()):
        data = p.read_bytes()
        if p.name == layout.MARKER_NAME:
            data = json.dumps({**json.loads(data), "created": None}, sort_keys=True).encode()
        digest.update(f"{p.relative_to(shared)}\0{len(data)}\0".encode() + data)
    return digest.hexdigest()


def _single(shared: Path, env) -> dict[str, bytes]:
    key = _staged_input(shared)
    if key not in _SINGLE:
        p = _watch(shared.parent, env.url("single"))
        rc, log = _done(p)
        assert rc == 0, log
        _SINGLE[key] = _tree(_keys(env), env, "single")
    return _SINGLE[key]


def _export_bytes(root: Path) -> list[int | None]:
    j = Journal.open_readonly(root)
    try:
        return [s.export_bytes for s in j.steps()]
    finally:
        j.close()


def _published_states(root: Path) -> list[str]:
    j = Journal.open_readonly(root)
    try:
        return [str(s.state) for s in j.steps()]
    finally:
        j.close()


def test_two_node_daemons_started_apart_publish_the_single_node_export(tmp_path, dcp_mixed2, s3):  # noqa: F811
    shared, node_dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    single = _single(shared, s3)
    late = _watch(node_dirs[1].parent, s3.url("fleet"))  # the leader comes second, a while later
    time.sleep(3)
    lead = _watch(node_dirs[0].parent, s3.url("fleet"))
    (rc1, log1), (rc0, log0) = _done(late), _done(lead)
    assert (rc0, rc1) == (0, 0), log0 + log1
    assert _tree(_keys(s3), s3, "fleet") == single and len(single) > 3
    assert s3.get("fleet/latest") == layout.step_dir_name(STEP).encode()
    assert "fleet node 1 of 2 built" in log1 and "fleet node 0 of 2 built" in log0
    for d in node_dirs:
        assert _published_states(d.parent) == ["published"]
    assert [k for k in _keys(s3) if k.startswith("fleet/raw/")]  # the exchange's input: the raw backup


@pytest.mark.parametrize(
    ("node", "point"),
    [
        (1, "fleet.raw_upload"),
        (1, "fleet.built"),
        (0, "fleet.build"),
        (0, "fleet.commit"),
        (0, "fleet.manifest"),
    ],
)
def test_a_node_killed_at_a_fleet_point_completes_the_step_once_on_restart(
    tmp_path,
    dcp_mixed2,
    s3,  # noqa: F811
    node,
    point,
):
    shared, node_dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    single = _single(shared, s3)
    other = _watch(node_dirs[1 - node].parent, s3.url("fleet"))
    killed = _watch(node_dirs[node].parent, s3.url("fleet"), env={ENV: point})
    rc, log = _done(killed)
    assert rc == -9, log
    manifest = f"fleet/{layout.step_dir_name(STEP)}/{layout.MANIFEST_NAME}"
    if point != "fleet.manifest":
        assert manifest not in _keys(s3)  # nothing is a step before the manifest
    if point == "fleet.raw_upload":  # killed mid-way through its raw part: some files there, no manifest
        raw = f"fleet/raw/{layout.step_dir_name(STEP)}/node-00001-of-00002/"
        assert [k for k in _keys(s3) if k.startswith(raw)]
        assert raw + layout.MANIFEST_NAME not in _keys(s3)
    again = _watch(node_dirs[node].parent, s3.url("fleet"))
    (rc2, log2), (rc1, log1) = _done(again), _done(other)
    assert (rc2, rc1) == (0, 0), log2 + log1
    assert _tree(_keys(s3), s3, "fleet") == single
    assert s3.get("fleet/latest") == layout.step_dir_name(STEP).encode()
    puts = [k for k in _keys(s3) if k.endswith(layout.MANIFEST_NAME) and k.startswith("fleet/step-")]
    assert puts == [manifest]
    # nothing reads the raw parts again: remote retention may take them (kept forever without it)
    assert f"fleet/fleet/{layout.step_dir_name(STEP)}/done.json" in _keys(s3)


def test_a_node_that_never_starts_times_out_once_and_stays_waiting(tmp_path, dcp_mixed2, s3):  # noqa: F811
    _, node_dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    p = _watch(
        node_dirs[0].parent,
        s3.url("fleet"),
        "--fleet-wait-seconds",
        "1",
        "--keep-last",
        "0",
    )
    t0 = time.monotonic()
    rc, log = _done(p)
    assert rc == 1 and time.monotonic() - t0 < 30, log  # one wait of the setting, not --max-attempts of them
    line = [ln for ln in log.splitlines() if ln.startswith(f"  step {STEP}: ")]
    assert len(line) == 1 and "still waiting (not quarantined): FleetWaitError: " in line[0], log
    assert "waiting for node 1 (seen: node-00000-of-00002)" in line[0] and FleetWaitError.hint in line[0]
    assert not [k for k in _keys(s3) if k.startswith(f"fleet/{layout.step_dir_name(STEP)}/")]
    assert (node_dirs[0] / "model").is_dir()  # kept: never deleted before the whole step is published
    j = Journal.open_readonly(node_dirs[0].parent)
    try:
        (row,) = j.steps()
    finally:
        j.close()
    # left waiting, not quarantined: failed with no next try, which the next start makes due again
    assert (row.state, row.error_class, row.next_try) == ("failed", "FleetWaitError", None)


def test_a_sigterm_while_a_node_waits_for_another_stops_at_once(tmp_path, dcp_mixed2):
    """A running daemon's fleet wait (up to `fleet_wait_seconds`, 600 by default) only polls the exchange:
    a SIGTERM ends it at once, abandoned as the drain abandons work (the attempt given back), rather than
    holding the shutdown for the whole grace period (60 s; past a pod's 30 s that is a SIGKILL)."""
    import signal

    from tests.cli_helpers import start_cli

    _, node_dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    root, url = node_dirs[0].parent, (tmp_path / "sink").as_uri()
    p = start_cli(["watch", root, "--sink", url, "--max-shard-size", str(SHARD), *fast_flags()])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and p.poll() is None:
        try:
            j = Journal.open_readonly(root)
        except JournalError:
            time.sleep(0.2)  # not made yet, or not set up yet
            continue
        try:
            if STEP in j.waits():
                break
        finally:
            j.close()
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    rc, log = _done(p, timeout=90)
    assert rc == 0 and time.monotonic() - t0 < 20, log
    j = Journal.open_readonly(root)
    try:
        (row,) = j.steps()
    finally:
        j.close()
    assert (row.state, row.attempts) == ("committed", 0), log  # resumed by the next start
    assert "abandoned at shutdown" in log


def _status(root: Path) -> str:
    r = run_cli(["status", root], env={"COLUMNS": "200"})
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def _await_status(root: Path, text: str, timeout: float = 60, without: str | None = None) -> str:
    deadline, out = time.monotonic() + timeout, ""
    while time.monotonic() < deadline:
        r = run_cli(["status", root], env={"COLUMNS": "200"})
        out = r.stdout + r.stderr  # no journal yet, until the daemon has started
        if text in out and (without is None or without not in out):
            return out
        time.sleep(0.3)
    raise AssertionError(f"`stagerd status` never showed {text!r} (without {without!r}); last:\n{out}")


def test_three_node_daemons_one_late_show_the_wait_in_status_then_publish_the_single_export(
    tmp_path,
    dcp_mixed,
    s3,  # noqa: F811
):
    """N = 3 through `stagerd watch ROOT_k --once`, with the wait visible in `stagerd status` as it happens.

    Node 0 first runs alone with a 1 s wait: it exits 1 and its journal keeps the step waiting for nodes 1
    and 2. Started again (re-armed by the start), with node 2, `stagerd status ROOT_0` shows the wait for
    node 1 alone; node 1 then starts 5 s after the others have begun waiting. That stands for a node
    minutes late: the waits are polls whose only clock is the deadline, so only --fleet-wait-seconds (here
    120 s) tells seconds from minutes."""
    shared, node_dirs = _stage(tmp_path, dcp_mixed[0], 3)
    single = _single(shared, s3)
    roots = [d.parent for d in node_dirs]
    url, wait = s3.url("fleet"), ["--fleet-wait-seconds", "120"]
    rc, log = _done(_watch(roots[0], url, "--fleet-wait-seconds", "1"))
    assert rc == 1 and "FleetWaitError" in log, log
    left = _status(roots[0])  # after the run: the journal says what the step still waits for
    assert "waiting for node 1, 2 (seen: node-00000-of-00003)" in left and "FleetWaitError" in left, left
    first = [_watch(roots[0], url, *wait), _watch(roots[2], url, *wait)]
    now = _await_status(roots[0], "waiting for node 1 (seen: node-00000-of-00003, node-00002-of-00003)")
    assert "still waiting" not in now and "exporting" in now, now
    _await_status(roots[2], "waiting for node 1 (seen: node-00000-of-00003, node-00002-of-00003)")
    time.sleep(5)
    late = _watch(roots[1], url, *wait)
    results = [_done(p) for p in [*first, late]]
    assert [rc for rc, _ in results] == [0, 0, 0], results
    assert _tree(_keys(s3), s3, "fleet") == single and len(single) > 4
    assert s3.get("fleet/latest") == layout.step_dir_name(STEP).encode()
    for k, (_, log) in zip((0, 2, 1), results, strict=True):
        assert f"fleet node {k} of 3 built" in log, log
    for root in roots:
        assert _published_states(root) == ["published"]
        assert "waiting" not in _status(root)  # the wait is over everywhere
        # each node's journal holds the whole export's size, as the sink shows it, not its share
        assert _export_bytes(root) == [sum(map(len, single.values()))]


def test_an_exchange_apart_from_two_sinks_each_holding_the_single_export(tmp_path, dcp_mixed2, s3):  # noqa: F811
    """Two sinks, S3 and file://: each owner uploads its files to both, the leader commits each, so both
    hold the single-node export byte for byte, with their own manifest and `latest`."""
    shared, node_dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    single = _single(shared, s3)
    ex, second = tmp_path / "exchange", tmp_path / "second"  # mounts every node shares
    sinks = ["--sink", second.as_uri(), "--exchange", ex.as_uri(), "--keep-last", "0"]
    procs = [_watch(d.parent, s3.url("fleet"), *sinks) for d in node_dirs]
    results = [_done(p) for p in procs]
    assert [rc for rc, _ in results] == [0, 0], results
    assert _tree(_keys(s3), s3, "fleet") == single
    out = second / layout.step_dir_name(STEP)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name != layout.MANIFEST_NAME} == single
    assert (out / layout.MANIFEST_NAME).is_file() and (second / "latest").read_text() == out.name
    assert not [k for k in _keys(s3) if k.startswith(("fleet/raw/", "fleet/fleet/"))]  # all on the exchange
    assert not (second / "raw").exists() and not (second / "fleet").exists()
    assert (ex / "raw" / layout.step_dir_name(STEP) / "node-00001-of-00002" / layout.MANIFEST_NAME).is_file()
    assert not any(d.exists() for d in node_dirs)  # published everywhere: then, and only then, retired


def test_the_wait_for_a_node_is_in_healthz_detail_and_the_metrics(tmp_path, dcp_mixed2, s3):  # noqa: F811
    import urllib.request

    from tests.daemon_helpers import free_port

    _, node_dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    port = free_port()
    args = ["--sink", s3.url("fleet"), "--fleet-wait-seconds", "60", "--grace-seconds", "1"]
    p = start_cli(["watch", node_dirs[0].parent, *args, *fast_flags(metrics_port=port)])
    try:
        deadline, health, metrics = time.monotonic() + 60, {}, ""
        while time.monotonic() < deadline and "fleet" not in health:
            time.sleep(0.3)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
                    health = json.loads(r.read())
            except OSError as e:
                health = {"error": str(getattr(e, "read", lambda: b"")())}
        assert health.get("fleet", {}).get(str(STEP), "").startswith("waiting for node 1 (seen: "), health
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            metrics = r.read().decode()
        assert f'stagerd_fleet_waiting_nodes{{step="{STEP}"}} 1.0' in metrics
    finally:
        p.terminate()
        p.communicate(timeout=60)


def test_two_hub_sinks_each_get_the_step_and_each_wait_is_shown_on_its_own(tmp_path, dcp_mixed2):
    """Two Hub sinks with a file:// exchange: each gets one commit and one tag, every file equal to the
    single-node export. Node 0's two lanes each download and publish the step (they once shared one work
    directory and one `hub.json`, so one lane removed the other's download and sink b never got the step,
    while node 1 took b's record for a's and retired its step). With b's commits held, node 1's lane for a
    is done while its lane for b waits: /healthz and `stagerd status` show that wait, keyed by sink, and
    a's ending has not cleared it. Released, b gets its commit and tag too."""
    import urllib.request

    from huggingface_hub import HfApi, hf_hub_download

    from stagerd.engine.export import export_step
    from tests.daemon_helpers import free_port
    from tests.hubserver import HubServer

    shared, node_dirs = _stage(tmp_path, dcp_mixed2[0], 2)
    want = export_step(shared, max_shard_size=SHARD).export_dir
    ex, port = tmp_path / "exchange", free_port()
    with HubServer() as hub:
        env = {"HF_ENDPOINT": hub.endpoint, "HF_TOKEN": hub.token, "HF_HUB_DISABLE_XET": None}
        hub.hang(r"/acme/b/commit/", method="POST")
        args = ["--sink", "hf://acme/b", "--exchange", ex.as_uri(), "--fleet-wait-seconds", "60"]
        procs = [
            _watch(d.parent, "hf://acme/a", *args, *(["--metrics-port", str(port)] * k), env=env)
            for k, d in enumerate(node_dirs)
        ]
        try:
            wait_b = f"waiting for node 0 to publish step {STEP} to the Hub sink hf://acme/b"
            # a's lane ends first: b's wait is still there, on its own line
            shown = _await_status(node_dirs[1].parent, f"step {STEP} [2]: {wait_b}", without="[1] waiting")
            assert "published" in shown, shown
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
                fleet = json.loads(r.read())["fleet"]
            assert list(fleet) == [f"{STEP} on hf://acme/b"] and fleet[f"{STEP} on hf://acme/b"].startswith(
                wait_b
            ), fleet
        finally:
            hub.unhang()
        results = [_done(p) for p in procs]
        assert [rc for rc, _ in results] == [0, 0], results
        api = HfApi(endpoint=hub.endpoint, token=hub.token)
        for repo in ("acme/a", "acme/b"):
            assert {t.name for t in api.list_repo_refs(repo).tags} == {f"step-{STEP}"}, repo
            commits = [c.title for c in api.list_repo_commits(repo) if c.title.startswith("stagerd:")]
            assert commits == [f"stagerd: step {STEP}"], repo
            for p in sorted(want.iterdir()):
                got = hf_hub_download(
                    repo,
                    p.name,
                    revision=f"step-{STEP}",
                    endpoint=hub.endpoint,
                    token=hub.token,
                    cache_dir=tmp_path / "hf-cache",
                )
                assert Path(got).read_bytes() == p.read_bytes(), (repo, p.name)
    assert "waiting" not in _status(node_dirs[1].parent)
