"""Every request stagerd makes to the Hub names stagerd and its version in its User-Agent, so a Hub's
operators can tell its traffic apart: the sink's publish and a restore's reads alike (a restore once sent
huggingface_hub's bare agent on its API calls)."""

from __future__ import annotations

from stagerd import __version__
from stagerd.sinks.hub.fetch import restore_hub_export
from tests.sinks.hub.hub_helpers import REPO, make_sink, one_file_export


def test_publish_and_restore_name_stagerd_in_every_request(hub, tmp_path):
    make_sink(hub).publish(one_file_export(tmp_path, 5), 5)
    restore_hub_export(f"hf://{REPO}?endpoint={hub.endpoint}&token={hub.token}", tmp_path / "o", 5)

    seen = {(r.method, r.path.split("?")[0]): r.user_agent for r in hub.stats.requests}
    assert seen
    unnamed = {k: ua for k, ua in seen.items() if f"stagerd/{__version__}" not in ua}
    assert not unnamed
