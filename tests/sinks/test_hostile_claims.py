"""A claim is anyone's bytes on a shared store: whatever it holds, it reads as a claim (an unreadable one as
"unknown"), and the prune and publish that read it go on."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from stagerd.contract import layout
from stagerd.sinks import claims
from stagerd.sinks.fsspec import FsspecSink
from stagerd.sinks.local import HOST
from tests.cli_helpers import run_cli
from tests.sinks.test_sink_fsspec import make_export

NESTED = b"[" * 100_000  # within the 128 KiB a claim may have; the JSON decoder recurses once a level
INFINITE_PID = b'{"kind": "prune", "owner": "x", "pid": Infinity}'


@settings(max_examples=300, deadline=None)
@given(
    data=st.binary(max_size=64)
    | st.builds(
        lambda d: json.dumps(d).encode(),
        st.dictionaries(
            st.sampled_from(["kind", "owner", "host", "pid", "tree", "trees", "ancestors"]),
            st.none()
            | st.booleans()
            | st.integers()
            | st.floats()
            | st.text(max_size=8)
            | st.lists(st.text()),
        ),
    )
)
def test_any_bytes_decode_to_a_claim(data):
    c = claims.decode(data)
    assert c is not None
    claims.prune_is_dead(c, 5.0)


def test_a_claim_nested_deep_or_with_an_infinite_pid_is_unknown_not_a_traceback():
    """Before: RecursionError and OverflowError out of `decode`, through every prune of the prefix."""
    assert claims.decode(NESTED).kind == "unknown"
    assert claims.decode(INFINITE_PID).kind == "unknown"


def test_a_prune_claim_of_this_host_with_a_pid_past_any_process_is_dead():
    """Before: os.kill(10**20, 0) raised OverflowError; no process has such a pid, so the prune is dead."""
    raw = {"kind": claims.PRUNE, "owner": "x", "host": socket.gethostname(), "pid": 10**20}
    raw["pidns"] = claims.PID_NS  # this pid namespace: its pid is judged here
    assert claims.prune_is_dead(claims.decode(json.dumps(raw).encode()), 1.0)
    assert not claims.pid_alive(0) and not claims.pid_alive(-1)


def test_prune_and_publish_go_on_beside_hostile_claims_and_temp_names(tmp_path: Path):
    sink_dir = tmp_path / "sink"
    sink = FsspecSink.from_url(f"file://{sink_dir}")
    for step in (1, 2, 3):
        sink.publish(make_export(tmp_path / f"e{step}", {"a.safetensors": 100}, seed=step), step)
    claim_dir = sink_dir / "claims"
    (claim_dir / layout.step_dir_name(1)).write_bytes(NESTED)
    (claim_dir / layout.step_dir_name(2)).write_bytes(INFINITE_PID)
    # a temp name of this host's whose pid no process can have: before, OverflowError out of the sweep
    stray = sink_dir / f".latest.tmp-{HOST}-99999999999999999999-1"
    stray.write_bytes(b"x")
    sink.publish(make_export(tmp_path / "e4", {"a.safetensors": 100}, seed=4), 4)
    assert not stray.exists()
    r = run_cli(["prune", f"file://{sink_dir}", "--keep-last", "1"])
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    left = sorted(p.name for p in sink_dir.iterdir() if p.name.startswith("step-"))
    assert left == [layout.step_dir_name(4)], left
    assert os.listdir(claim_dir) == [layout.step_dir_name(4)]
