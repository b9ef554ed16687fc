"""`stagerd watch` publishing to the Hub through Xet: the Prometheus bytes counter is the wire's count, and a
publish held by a stalled CAS drains on SIGTERM like any other (hf_xet's own threads do not keep the daemon).
"""

from __future__ import annotations

import asyncio
import re
import signal

from huggingface_hub import HfApi
from huggingface_hub.utils import get_session

from stagerd.daemon.journal import Journal
from tests.cli_helpers import clean_env
from tests.daemon_helpers import fast_flags, free_port, is_state, stage_copy, start_watch
from tests.hubserver import HubServer

URL = "hf://acme/daemon"


def published_bytes(port: int) -> float:
    text = get_session().get(f"http://127.0.0.1:{port}/metrics").text
    m = re.search(r'^stagerd_published_bytes_total\{sink="hf://acme/daemon"\} (\S+)$', text, re.M)
    assert m is not None, text
    return float(m.group(1))


async def test_the_bytes_counter_is_the_wire_and_a_stalled_cas_drains_on_sigterm(tmp_path, dcp_mixed2):
    model, _ = dcp_mixed2
    root, port = tmp_path / "root", free_port()
    stage_copy(root, 1, model, world=2)
    with HubServer() as hub:
        env = clean_env({"HF_ENDPOINT": hub.endpoint, "HF_TOKEN": hub.token, "HF_HUB_DISABLE_XET": None})
        flags = [*fast_flags(metrics_port=port), "--grace-seconds", "1"]
        w = await start_watch(root, "--sink", URL, *flags, log_dir=tmp_path, env=env)
        try:
            await w.wait_for(is_state(1, "published", URL), timeout=60)
            api = HfApi(endpoint=hub.endpoint, token=hub.token)
            tree = api.list_repo_tree("acme/daemon", recursive=True, revision="step-1")
            inline = sum(f.size for f in tree if getattr(f, "lfs", 1) is None and f.path != ".gitattributes")
            wire = hub.stats.xet_bytes["xorb"] + hub.stats.xet_bytes["shard"]
            assert wire > 0 and published_bytes(port) == wire + inline

            stall = hub.hang(r"/v1/xorbs/", method="POST")  # the CAS takes step 2's xorb, never answers
            stage_copy(root, 2, model, world=2, dtype="bf16")  # other bytes than step 1's
            for _ in range(600):
                if stall.fired:
                    break
                await asyncio.sleep(0.05)
            assert stall.fired, w.text()[-3000:]  # the daemon's publish is inside hf_xet's upload now
            w.kill(signal.SIGTERM)
            assert await w.wait(20) == 0, w.text()[-3000:]
        finally:
            if w.proc.returncode is None:
                w.kill(signal.SIGKILL)
            hub.unhang()
        assert "SIGTERM: no new work; draining" in w.text() and "abandoned at shutdown" in w.text()
        assert hub.stats.commits["acme/daemon"] == 1  # step 2 was never committed
    journal = Journal.open_readonly(root)
    try:
        assert [ln.state for ln in journal.lanes(2)] == ["pending"]  # given back, published on a restart
    finally:
        journal.close()
