"""A sink added to a ROOT whose older steps retention already retired: it gets what is still staged, and
every report names the retired steps it never got, instead of counting them as published there."""

from __future__ import annotations

import json

import pytest

from tests.daemon_helpers import fast_flags, manifests, run_cli, stage_copy, start_watch, stop_cleanly

pytestmark = pytest.mark.slow


async def test_a_sink_added_later_is_told_which_retired_steps_it_never_got(tmp_path, dcp_mixed2):
    src, _ = dcp_mixed2
    root, a, b = tmp_path / "root", tmp_path / "a", tmp_path / "b"
    root.mkdir()
    for step in (1, 2, 3):
        stage_copy(root, step, src, 2)
    common = ["--keep-last", "1", "--once", *fast_flags()]
    rc, out, err = await run_cli("watch", str(root), "--sink", a.as_uri(), *common)
    assert rc == 0 and "all 3 step(s) published" in err and "never got" not in out + err, out + err
    assert "3 step(s) published, 0 not (3 published by this run)" in out and "3 by this run" in err, out
    assert sorted(manifests(a)) == [1, 2, 3]

    rc, out, err = await run_cli("watch", str(root), "--sink", a.as_uri(), "--sink", b.as_uri(), *common)
    assert rc == 0, out + err  # nothing a later run could do: not a failure
    assert sorted(manifests(b)) == [3]  # what is still staged
    assert "all 3 step(s) published" not in err, err
    # the count is ROOT's; what this run did is said apart (before, only the count: a cron's run that
    # published nothing new said "3 step(s) published" like the run that published them)
    assert "3 step(s) published, 0 not (1 published by this run)" in out, out  # step 3, to b
    assert f"{b.as_uri()} lacks 2 (retired before it was configured)" in err, err
    said = f"{b.as_uri()} never got 2 step(s) (1, 2): retention deleted their staged data"
    assert said in out and said in err, out + err
    assert a.as_uri() + " never got" not in out + err

    rc, out, _ = await run_cli("status", str(root), "--json")
    assert rc == 0 and json.loads(out)["missed"] == {b.as_uri(): {"count": 2, "newest": [1, 2]}}
    rc, out, _ = await run_cli("status", str(root), env=None)
    assert rc == 0 and "never got 2 step(s) (1, 2)" in " ".join(out.split()), out

    # a daemon (not --once) says it when it starts with a new sink, and only for that sink
    c = tmp_path / "c"
    sinks = ["--sink", a.as_uri(), "--sink", b.as_uri(), "--sink", c.as_uri()]
    w = await start_watch(root, *sinks, "--keep-last", "1", *fast_flags(), log_dir=tmp_path / "logs")
    try:
        said = await w.wait_for(lambda r: "missed" in r)
        assert said["sink"] == c.as_uri() and said["missed"] == [1, 2], said
        await w.wait_for(
            lambda r: r.get("step") == 3 and r.get("sink") == c.as_uri() and r.get("state") == "published"
        )
    finally:
        await stop_cleanly(w)
    assert [r["sink"] for r in w.records() if "missed" in r] == [c.as_uri()]
