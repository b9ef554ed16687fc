"""A sink outage never quarantines a step for good (issue 19, item 10).

A `--once` run gives up on a failure that may pass after `max_attempts` and exits 1; the next start tries
again on its own, without editing the journal. A running daemon keeps retrying (tests/daemon/test_policy).
"""

from __future__ import annotations

import json

from stagerd.contract import layout
from tests.cli_helpers import run_cli
from tests.daemon_helpers import fast_flags, stage_copy


def test_the_next_start_retries_what_an_outage_quarantined(tmp_path, dcp_mixed2):
    model, _ = dcp_mixed2
    root, blocker = tmp_path / "root", tmp_path / "blocker"
    blocker.write_text("a file where the sink's directory should be: the sink is down")
    sink = blocker / "sink"
    stage_copy(root, 100, model, world=2)
    args = ["watch", root, "--sink", sink.as_uri(), "--once", "--max-attempts", "1", *fast_flags()]
    down = run_cli(args)
    assert down.returncode == 1, down.stderr[-3000:]
    # what the user reads says the next start tries again, never that only `stagerd retry` will
    assert "the next `stagerd watch` tries those steps again" in down.stdout, down.stdout
    assert "stagerd retry" not in down.stdout + down.stderr, down.stdout + down.stderr[-3000:]
    status = json.loads(run_cli(["status", root, "--json"]).stdout)
    (lane,) = status["steps"][0]["lanes"]
    assert lane["state"] == "quarantined", lane
    text = run_cli(["status", root], env={"COLUMNS": "200"}).stdout
    assert "tries those steps again" in text and "stagerd retry" not in text, text

    blocker.unlink()  # the sink is back
    back = run_cli(args)
    assert back.returncode == 0, back.stderr[-3000:]
    assert "re-armed at start" in back.stderr
    assert "quarantined in the journal" not in back.stderr, back.stderr[-3000:]
    assert (sink / "step-00000100" / layout.MANIFEST_NAME).is_file()
