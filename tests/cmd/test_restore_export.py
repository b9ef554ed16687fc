"""`stagerd restore --export`: a published HF export from a file://, S3 or Hub sink back into a plain
directory, checked against what the sink lists; a download cut midway goes on or is a named error, and
nothing lands on a refusal.
"""

from __future__ import annotations

import hashlib
import http.server
import threading

import pytest

from stagerd.contract import layout
from stagerd.sinks.fsspec import FsspecSink
from tests.cli_helpers import run_cli
from tests.cmd.restore_helpers import hub_with_step, raw_step, run_restore, tree
from tests.s3server import s3, s3_server  # noqa: F401  (fixtures)


def test_restores_a_published_hf_export_into_a_plain_directory(tmp_path, dcp_mixed2):
    from stagerd.engine.export import export_step

    step_dir = raw_step(tmp_path / "orig", 5, dcp_mixed2[0])
    export_step(step_dir)
    sink_dir = tmp_path / "sink"
    FsspecSink.from_url(sink_dir.as_uri()).publish(step_dir / layout.EXPORT_DIR, 5)
    out = tmp_path / "eval-5"
    r = run_restore(sink_dir.as_uri(), out, "--export")
    assert r.returncode == 0, r.stderr
    assert tree(out) == tree(step_dir / layout.EXPORT_DIR)
    r = run_cli(["verify", out])
    assert r.returncode == 0, r.stderr
    r = run_restore(sink_dir.as_uri(), out, "--export")
    assert r.returncode == 2 and "not an empty directory" in r.stderr


def test_a_restore_of_what_a_sink_lacks_names_what_it_holds(tmp_path, dcp_mixed2):
    """A sink published without --publish-raw holds exports only: a raw restore was told "no step was
    published here". It names the exported steps, newest first, and how to restore one, or to publish raw
    steps to resume training; a step that is not there names those that are."""
    from stagerd.engine.export import export_step

    step_dir = raw_step(tmp_path / "orig", 5, dcp_mixed2[0])
    export_step(step_dir)
    sink_dir = tmp_path / "sink"
    sink = FsspecSink.from_url(sink_dir.as_uri())
    for n in range(1, 8):
        sink.publish(step_dir / layout.EXPORT_DIR, n)
    r = run_restore(sink_dir.as_uri(), tmp_path / "root")
    flat = " ".join(r.stderr.split())
    assert r.returncode == 2 and "no raw step was published here" in flat, r.stderr
    assert "only 7 exported step(s): 7, 6, 5, 4, 3, ... (newest first)" in flat, r.stderr
    assert "--export --step 7" in flat and "--publish-raw" in flat, r.stderr
    r = run_restore(sink_dir.as_uri(), tmp_path / "root", "--step", "5")
    assert "--export --step 5" in " ".join(r.stderr.split()), r.stderr
    r = run_restore(sink_dir.as_uri(), tmp_path / "eval-9", "--export", "--step", "9")
    flat = " ".join(r.stderr.split())
    assert r.returncode == 2 and "the sink holds 7 exported step(s): 7, 6, 5, 4, 3, ..." in flat, r.stderr
    assert "--step 7" in flat and not (tmp_path / "eval-9").exists(), r.stderr


def test_restores_an_hf_export_from_the_hub_checked_against_its_tree(tmp_path):
    from tests.sinks.hub.hub_helpers import export_files

    with hub_with_step(tmp_path) as (hub, url, env, export):
        r = run_restore(url, tmp_path / "eval-7", "--export", "--step", "7", env=env)
        assert r.returncode == 0, r.stderr
        got = tree(tmp_path / "eval-7")
        assert {k: v for k, v in got.items() if k != "README.md"} == export_files(export)  # + the card
        r = run_restore(url, tmp_path / "raw", "--step", "7", env=env)
        assert r.returncode == 2 and "--export" in r.stderr
        # a step the repo lacks names the steps it holds, as from S3 or file://
        r = run_restore(url, tmp_path / "eval-9", "--export", "--step", "9", env=env)
        flat = " ".join(r.stderr.split())
        assert r.returncode == 2 and "the sink holds 1 exported step(s): 7 (newest first)" in flat, r.stderr
        assert "(`--step 7`: the newest)" in flat and not (tmp_path / "eval-9").exists(), r.stderr
        r = run_restore(url, tmp_path / "denied", "--export", env={**env, "HF_TOKEN": "hf_" + "x" * 34})
        assert r.returncode == 2 and "SinkAuthError" in r.stderr, r.stderr
        hint = r.stderr.split("what to do: ", 1)[1]
        assert "HF_TOKEN" in hint and "?token=" in hint and "AWS" not in hint, r.stderr  # the Hub's only
        big = max(export.glob("*.safetensors"), key=lambda p: p.stat().st_size)
        hub.tamper(hashlib.sha256(big.read_bytes()).hexdigest(), at=100)
        r = run_restore(url, tmp_path / "bad", "--export", env=env)
        assert r.returncode == 2 and "RestoreError" in r.stderr and big.name in r.stderr, r.stderr
        assert not (tmp_path / "bad").exists() and not list(tmp_path.glob(".bad.*"))


def _cut_bodies(monkeypatch, key_part: str, times: int, between=lambda: None) -> list[str]:
    """The test proxy sends the first `times` GETs of a key containing `key_part` only half their body,
    then drops the connection (`between` runs before each cut); the ranges asked for are returned."""
    from tests.s3server import FaultProxy

    forward, ranges = FaultProxy.__call__, []

    def call(self, environ, start_response):
        out = forward(self, environ, start_response)
        if environ["REQUEST_METHOD"] != "GET" or key_part not in environ.get("RAW_URI", ""):
            return out
        ranges.append(environ.get("HTTP_RANGE", ""))
        if len(ranges) > times:
            return out
        data = b"".join(out)
        between()

        def half():
            yield data[: len(data) // 2]
            raise ConnectionResetError("cut by the test")

        return half()

    monkeypatch.setattr(FaultProxy, "__call__", call)
    return ranges


@pytest.mark.parametrize("case", ["resumed", "cut-often-going-on", "cut-for-good", "replaced"])
def test_an_s3_download_cut_midway_goes_on_or_is_a_named_error(tmp_path, s3, monkeypatch, case):  # noqa: F811
    """A connection reset after an S3 GET's answer began (botocore retries only until then). Before the
    fix, a raw `aiohttp.ClientPayloadError` ended the restore (a traceback, exit 1) at the first cut. The
    cuts it survives are those in a row: one a chunk or more after the last starts the count again, so a
    file cut more often than that, each time further on, still comes whole (before: a `SinkError`)."""
    from stagerd.cmd.restore import restore_export
    from stagerd.errors import RestoreError, SinkError
    from stagerd.sinks import fetch
    from stagerd.sinks.remote import RemoteStore

    export = tmp_path / "export"
    export.mkdir()
    (export / "model.safetensors").write_bytes(bytes(range(256)) * (4 << 10))  # 1 MiB
    (export / "config.json").write_text("{}")
    sink = FsspecSink.from_url(s3.url("run"))
    sink.publish(export, 4)
    sink.close()
    key = f"run/{layout.step_dir_name(4)}/model.safetensors"
    other = lambda: s3.client.put_object(Bucket=s3.bucket, Key=key, Body=b"x" * (1 << 20))  # noqa: E731
    times = {"resumed": 2, "cut-often-going-on": 4, "cut-for-good": 9, "replaced": 1}[case]
    ranges = _cut_bodies(
        monkeypatch, "model.safetensors", times, other if case == "replaced" else lambda: None
    )
    monkeypatch.setattr(fetch, "STREAM_RETRIES", 2)
    monkeypatch.setattr(fetch, "STREAM_BACKOFF_S", 0.0)
    # the 4 cuts come half of what was left (512, 256, 128, 64 KiB) after the last: a new row each time
    monkeypatch.setattr(fetch, "STREAM_CHUNK", (16 << 10) if case == "cut-often-going-on" else (8 << 20))
    out = tmp_path / "eval"
    store = RemoteStore.open(s3.url("run"))
    try:
        if case == "resumed":
            restore_export(store, out, 4)
            assert tree(out) == tree(export)
            # each GET goes on from the byte the last one reached: at most the half the proxy sent (a
            # cut can land before the client has read all of it)
            first, second = (int(r.removeprefix("bytes=").removesuffix("-")) for r in ranges[1:])
            assert ranges[0] == "" and len(ranges) == 3, ranges
            assert 0 < first <= (1 << 19) and first < second <= first + ((1 << 20) - first) // 2, ranges
            return
        if case == "cut-often-going-on":
            restore_export(store, out, 4)  # 4 cuts, more than STREAM_RETRIES, none in a row
            assert tree(out) == tree(export) and len(ranges) == 5, ranges
            return
        error = SinkError if case == "cut-for-good" else RestoreError
        with pytest.raises(error, match=r"cut 3 time|changed on the sink") as e:
            restore_export(store, out, 4)
    finally:
        store.close()
    assert e.value.retryable == (case == "cut-for-good") and key in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # nothing landed, no temp left


@pytest.mark.parametrize("out", [".", "./"])
def test_an_export_restores_into_the_empty_directory_one_is_in(tmp_path, monkeypatch, capsys, out):
    """`mkdir eval && cd eval && stagerd restore URL . --export`. Before the fix: a raw `ValueError:
    PosixPath('.') has an empty name` traceback (exit 1), for file://, S3 and the Hub alike."""
    from stagerd.cli import main

    export, here = tmp_path / "export", tmp_path / "eval"
    export.mkdir()
    (export / "config.json").write_text("{}")
    FsspecSink.from_url((tmp_path / "sink").as_uri()).publish(export, 3)
    here.mkdir()
    monkeypatch.chdir(here)
    assert main(["restore", (tmp_path / "sink").as_uri(), out, "--export"]) == 0
    assert f"restored {here}" in capsys.readouterr().out
    assert tree(here) == tree(export)


def test_a_hub_that_cannot_be_reached_is_a_named_error_not_a_traceback(tmp_path):
    """Before: the httpx ConnectError of a Hub that refuses connections, or drops each download, came out
    as a raw traceback (exit 1); now a retryable SinkError (exit 3). Two attempts with a short backoff: each
    attempt's download is already tried six times by huggingface_hub itself, a second apart."""
    from tests.hubserver.faults import Fault

    with hub_with_step(tmp_path) as (hub, url, env, _export):
        url += "&max_attempts=2&backoff_base=0.05&backoff_max=0.05"
        hub.faults.add(Fault("GET", r"/resolve/", drop=True, times=1000))
        r = run_restore(url, tmp_path / "dropped", "--export", env=env)
        assert r.returncode == 3 and "SinkError" in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert not (tmp_path / "dropped").exists() and not list(tmp_path.glob(".dropped.*"))
        _says_to_run_it_again(r.stderr)
    r = run_restore(url, tmp_path / "down", "--export", env=env)  # the server is gone: nothing listens
    assert r.returncode == 3 and "SinkError" in r.stderr and "Traceback" not in r.stderr, r.stderr
    _says_to_run_it_again(r.stderr)
    assert not (tmp_path / "down").exists()


def _says_to_run_it_again(stderr: str) -> None:
    """A restore has given up when it ends: its hint is what to do now, not the daemon's backoff."""
    hint = stderr.split("what to do: ", 1)[1]
    assert "run the restore again" in hint and "?max_attempts=" in hint and "?endpoint=" in hint, stderr
    assert "stagerd retries" not in hint, stderr


@pytest.mark.parametrize(
    "bad",
    [
        "../evil",
        "/abs/evil",
        "a\\..\\..\\evil",
        "config.json/x",
        ".cache/huggingface/x",
        "C:evil",
        "a/d:evil",
    ],
)
def test_a_hub_tree_naming_a_path_no_export_holds_is_refused_before_any_download(tmp_path, bad):
    """A hostile Hub's tree: before, `..` and absolute names came out as a raw ValueError (exit 1) from
    huggingface_hub's own check, a file also listed as a directory as a raw FileExistsError half way, and
    a file under `.cache/` (huggingface_hub's own) was downloaded and then deleted: the restore said done.
    A name with a Windows drive (`C:evil`), which huggingface_hub refuses on every platform, passed stagerd's
    check and came out of hf_hub_download as a bare ValueError."""
    from tests.hubserver.store import Blob

    with hub_with_step(tmp_path) as (hub, url, env, _export):
        for commit in hub.store.repos["acme/llm"].commits.values():
            commit.tree[bad] = Blob.regular(b"evil")
        gets = hub.stats.count("GET", r"/resolve/")
        r = run_restore(url, tmp_path / "out", "--export", env=env)
        assert r.returncode == 2 and "RestoreError" in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert repr(bad) in r.stderr, r.stderr  # the path named
        assert hub.stats.count("GET", r"/resolve/") == gets
    assert not (tmp_path / "out").exists() and not list(tmp_path.rglob("*evil*"))


class _Failing(http.server.BaseHTTPRequestHandler):
    """Every request answered 500, as a broken web server or proxy in front of a read-only sink."""

    def do_GET(self):
        self.send_response(500)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = do_PUT = do_GET

    def log_message(self, *args):
        pass


def test_an_http_sink_that_answers_an_error_is_a_named_error_not_a_traceback(tmp_path):
    """Before: aiohttp's ClientResponseError (not an OSError) came out raw, exit 1, reading `latest`; and a
    raw restore, which writes a lease to the sink, failed on the read-only store with NotImplementedError."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Failing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/ckpt"
        r = run_restore(url, tmp_path / "out", "--export")
        raw = run_restore(url, tmp_path / "raw", "--step", "3")
    finally:
        server.shutdown()
        server.server_close()
    assert r.returncode == 3 and "SinkError" in r.stderr and "HTTP 500" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "out").exists()
    assert raw.returncode == 2 and "ConfigError" in raw.stderr and "--export" in raw.stderr, raw.stderr
    assert "Traceback" not in raw.stderr and not (tmp_path / "raw").exists()
