"""S3 deletes by exact key, whatever the key holds and whatever the store refuses: a key that XML 1.0
cannot carry in `DeleteObjects`' body is deleted alone, and a
store that refuses the deletes for want of `s3:DeleteObject` says so, not to be retried.

Against moto behind the fault proxy (`tests/s3server.py`), through the real aiobotocore client."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator

import pytest
from werkzeug.serving import make_server

from stagerd.contract import layout
from stagerd.errors import SinkAuthError
from stagerd.sinks.fetch import RemoteStore
from stagerd.sinks.prune import prune
from stagerd.sinks.prune_plan import Policy
from stagerd.sinks.s3 import store as s3_store
from stagerd.sinks.s3.backend import S3Backend
from tests.s3server import FaultProxy, S3Env, s3, s3_server  # noqa: F401  (fixtures)


@pytest.fixture
def backend(s3: S3Env, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Backend]:  # noqa: F811
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # a refused batch is refused again by each retry
    b = S3Backend.open(s3.url("ckpt"), {}, part_size=5 << 20, max_concurrency=2, checksum="CRC32")
    yield b
    b.close()


def test_a_key_xml_cannot_carry_is_deleted_with_the_rest(s3, backend):  # noqa: F811
    """A file named with a control character: before, the whole `DeleteObjects` batch was refused
    (moto: 500, S3: MalformedXML) as a retryable error, so no key of it went."""
    for rel in ("step-1/a\x01b", "step-1/ok"):
        s3.client.put_object(Bucket=s3.bucket, Key=f"ckpt/{rel}", Body=b"x")
    s3_store.delete(backend, ["step-1/a\x01b", "step-1/ok"])
    assert s3.keys() == {}


def _put_step(s3: S3Env, step: int, names: tuple[str, ...]) -> None:  # noqa: F811
    base = f"ckpt/{layout.step_dir_name(step)}"
    for name in names:
        s3.client.put_object(Bucket=s3.bucket, Key=f"{base}/{name}", Body=b"w")
    manifest = {"format": layout.MANIFEST_FORMAT, "step": step, "files": [], "metadata": {}}
    s3.client.put_object(Bucket=s3.bucket, Key=f"{base}/{layout.MANIFEST_NAME}", Body=json.dumps(manifest))


def test_a_step_with_such_a_key_is_pruned_and_the_prune_goes_on(s3, monkeypatch):  # noqa: F811
    """Before, the prune stopped at step 1 with an error, and step 2 was never pruned either."""
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    _put_step(s3, 1, ("model.safetensors", "notes\x07.txt"))
    for step in (2, 3):
        _put_step(s3, step, ("model.safetensors",))
    store = RemoteStore.open(s3.url("ckpt"))
    try:
        decisions = prune(store, Policy(keep_last=1))
    finally:
        store.close()
    assert [(d.step, d.delete) for d in decisions] == [(1, True), (2, True), (3, False)]
    left = s3.keys("ckpt/")
    assert {k.split("/")[1] for k in left} == {layout.step_dir_name(3)}


class DeletesDenied(FaultProxy):
    """A store whose policy denies s3:DeleteObject: each key of a `DeleteObjects` comes back refused, as
    S3 answers it (200, with one `Error` per key)."""

    def _forward(
        self, method: str, raw_uri: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        if method != "POST" or "delete" not in raw_uri.partition("?")[2]:
            return super()._forward(method, raw_uri, headers, body)
        errors = "".join(
            f"<Error><Key>{k}</Key><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"
            for k in re.findall(rb"<Key>(.*?)</Key>", body)
            for k in [k.decode()]
        )
        data = (
            '<?xml version="1.0" encoding="UTF-8"?>'
            f'<DeleteResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">{errors}</DeleteResult>'
        ).encode()
        return 200, [("Content-Type", "application/xml"), ("Content-Length", str(len(data)))], data


def test_deletes_denied_are_a_permission_error_naming_the_permission(s3, monkeypatch):  # noqa: F811
    """Before: a retryable SinkError with the generic hint, so the daemon retried a prune no retry fixes."""
    proxy = DeletesDenied(upstream=s3.server.moto.get_host_and_port())
    server = make_server("127.0.0.1", 0, proxy, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{server.server_port}")
    s3.client.put_object(Bucket=s3.bucket, Key="ckpt/step-1/a", Body=b"x")
    b = S3Backend.open(s3.url("ckpt"), {}, part_size=5 << 20, max_concurrency=2, checksum="CRC32")
    try:
        with pytest.raises(SinkAuthError, match="AccessDenied") as info:
            s3_store.delete(b, ["step-1/a"])
    finally:
        b.close()
        server.shutdown()
        server.server_close()
        thread.join()
    assert not info.value.retryable
    assert f"s3:DeleteObject on arn:aws:s3:::{s3.bucket}/ckpt/*" in info.value.hint
    assert s3.keys() == {"ckpt/step-1/a": 1}
