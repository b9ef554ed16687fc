"""What another tool or a broken writer left at a key stagerd reads while publishing (a step's manifest, its
claim): a FIFO on file:// or an object of any size on S3 is a named error for that step, read no further
than a manifest can be, and the sink's other steps go on."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from stagerd.contract import layout
from stagerd.errors import SinkConflictError, SinkError
from stagerd.sinks.fsspec import FsspecSink
from tests.cli_helpers import run_cli
from tests.s3server import s3, s3_server  # noqa: F401  (fixtures)
from tests.sinks.test_sink_fsspec import make_export


def _in_thread(fn) -> BaseException | None:
    """`fn()` in a thread, its error back; a hang is a test failure, not a hung suite."""
    out: list[BaseException | None] = [None]

    def run() -> None:
        try:
            fn()
        except BaseException as e:
            out[0] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "waited on a FIFO"
    return out[0]


@pytest.mark.parametrize("where", [f"step-00000002/{layout.MANIFEST_NAME}", "claims/step-00000002"])
def test_a_fifo_at_a_key_a_publish_reads_is_a_sink_error_not_a_wait(tmp_path: Path, where: str):
    """Before: `open()` of the FIFO waited for a writer, and the publish lane with it, for good."""
    sink_dir = tmp_path / "sink"
    sink = FsspecSink.from_url(f"file://{sink_dir}")
    sink.publish(make_export(tmp_path / "e1", {"a.safetensors": 100}, seed=1), 1)
    (sink_dir / where).parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(sink_dir / where)
    err = _in_thread(lambda: sink.publish(make_export(tmp_path / "e2", {"a.safetensors": 100}, seed=2), 2))
    assert isinstance(err, SinkError) and "not a regular file" in str(err), err
    sink.publish(make_export(tmp_path / "e3", {"a.safetensors": 100}, seed=3), 3)
    assert (sink_dir / layout.step_dir_name(3) / layout.MANIFEST_NAME).is_file()


def test_a_prune_beside_a_fifo_claim_is_a_named_error_not_a_wait(tmp_path: Path):
    sink_dir = tmp_path / "sink"
    sink = FsspecSink.from_url(f"file://{sink_dir}")
    for step in (1, 2):
        sink.publish(make_export(tmp_path / f"e{step}", {"a.safetensors": 100}, seed=step), step)
    (sink_dir / "claims" / layout.step_dir_name(1)).unlink()
    os.mkfifo(sink_dir / "claims" / layout.step_dir_name(1))
    r = run_cli(["prune", f"file://{sink_dir}", "--keep-last", "1"], timeout=60)
    assert r.returncode != 0 and "SinkError" in r.stderr and "not a regular file" in r.stderr, r.stderr


def test_an_oversized_object_at_a_manifest_key_is_refused_unread(s3, tmp_path, monkeypatch):  # noqa: F811
    """Before: the publish read the object whole into memory, whatever its size."""
    limit = 4096
    monkeypatch.setattr("stagerd.contract.manifest.MAX_MANIFEST_BYTES", limit)
    monkeypatch.setattr("stagerd.sinks.fsspec._MANIFEST", limit + 1)
    monkeypatch.setattr("stagerd.sinks.s3.opening._MANIFEST", limit + 1)
    key = f"ckpt/{layout.step_dir_name(2)}/{layout.MANIFEST_NAME}"
    s3.client.put_object(Bucket=s3.bucket, Key=key, Body=b"{" + b" " * (1 << 20))
    sink = FsspecSink.from_url(s3.url())
    before = s3.proxy.count("GetObject")
    with pytest.raises(SinkConflictError, match="larger than"):
        sink.publish(make_export(tmp_path / "e2", {"a.safetensors": 100}, seed=2), 2)
    assert s3.proxy.count("GetObject") > before
    sink.publish(make_export(tmp_path / "e3", {"a.safetensors": 100}, seed=3), 3)
    assert s3.get(key) == b"{" + b" " * (1 << 20)  # another's object: never overwritten
