"""S3-compatible stores that ignore `If-None-Match` / `If-Match` (they answer 2xx and overwrite or delete
anyway): the probe (`s3/conditions.py`) and what publishers, losers and prunes do then. The store is moto
behind the test proxy, which drops those headers of the operations a test names (`FaultProxy.ignores`): a
real HTTP hop. Each test but the first reproduces on the code before the probe (RELIABILITY.md, "Data
safety")."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from typing import Any

import pytest

from stagerd.contract import layout
from stagerd.errors import ConditionsIgnoredError, SinkAuthError, SinkConflictError, SinkError
from stagerd.sinks.fetch import RemoteStore
from stagerd.sinks.fsspec import FsspecSink
from stagerd.sinks.prune import Policy, prune
from stagerd.sinks.s3.backend import S3Backend
from stagerd.sinks.s3.conditions import PROBE_PREFIX
from tests.s3server import IGNORE_ALL, Fault, s3, s3_server  # noqa: F401  (fixtures)
from tests.sinks.test_sink_fsspec import make_export

SIZES = {"model.safetensors": 5000, "config.json": 300}
STEP7 = "race/step-00000007"


def _published_intact(s3: Any, prefix: str) -> dict[str, Any]:  # noqa: F811
    manifest: dict[str, Any] = json.loads(s3.get(f"{prefix}/{layout.MANIFEST_NAME}"))
    for f in manifest["files"]:
        assert hashlib.sha256(s3.get(f"{prefix}/{f['path']}")).hexdigest() == f["sha256"], f
    return manifest


def test_the_probe_is_eight_requests_once_per_backend_and_leaves_nothing(s3, tmp_path):  # noqa: F811
    """A store that honours every condition keeps the early create-only PUTs; the probe runs once."""
    sink = FsspecSink.from_url(s3.url("run"))
    for step in (1, 2):
        sink.publish(make_export(tmp_path / f"e{step}", SIZES, seed=step), step)
    sink.close()
    assert s3.proxy.count(key_contains=PROBE_PREFIX) == 8  # 7 on its two keys, the listing of dead ones
    assert [r.status for r in s3.proxy.log if PROBE_PREFIX in r.key].count(412) == 3
    assert not [k for k in s3.keys("") if PROBE_PREFIX in k]


def test_a_loser_never_overwrites_a_published_step_on_a_store_that_ignores_conditions(s3, tmp_path):  # noqa: F811
    """Y published step 7; X, with other bytes under the same names, publishes it again on a store that
    ignores If-None-Match. Before the fix X's create-only PUTs overwrote Y's files, its claim PUT took
    Y's claim, and its manifest replaced Y's: Y's published step silently became X's."""
    s3.proxy.ignores |= IGNORE_ALL
    FsspecSink.from_url(s3.url("race")).publish(make_export(tmp_path / "y", SIZES, seed=1), 7)
    y_manifest = s3.get(f"{STEP7}/{layout.MANIFEST_NAME}")
    y_claim = s3.get("race/claims/step-00000007")
    with pytest.raises(SinkConflictError):
        FsspecSink.from_url(s3.url("race")).publish(make_export(tmp_path / "x", SIZES, seed=2), 7)
    assert s3.get(f"{STEP7}/{layout.MANIFEST_NAME}") == y_manifest
    assert s3.get("race/claims/step-00000007") == y_claim
    _published_intact(s3, STEP7)


class _DiscardsLate(S3Backend):
    """A loser whose cleanup waits until released: another publisher's step can land meanwhile."""

    reached: threading.Event
    release: threading.Event

    def discard(self, keys: list[tuple[str, str | None]]) -> None:
        self.reached.set()
        assert self.release.wait(60)
        super().discard(keys)


def test_a_losers_cleanup_never_deletes_a_file_of_a_later_publish_when_delete_ignores_if_match(
    s3,  # noqa: F811
    tmp_path,
    caplog,
):
    """The store honours If-None-Match but ignores If-Match on DELETE (as RustFS does). X loses step 7 to
    Y's published manifest, with `extra.json` created early; before its cleanup runs, the step is deleted
    by hand and W publishes it again, `extra.json` included. Before the fix X's cleanup, If-Match dropped,
    deleted W's `extra.json`: W's published step lost a file its manifest names."""
    s3.proxy.ignores.add(("DeleteObject", "if-match"))
    FsspecSink.from_url(s3.url("race")).publish(make_export(tmp_path / "y", SIZES, seed=1), 7)
    real = FsspecSink.from_url(s3.url("race"))._backend
    assert isinstance(real, S3Backend)
    x_backend = _DiscardsLate(real.fs, real.bucket, real.root, real.part_size, real.max_concurrency)
    x_backend.reached, x_backend.release = threading.Event(), threading.Event()
    x_export = make_export(tmp_path / "x", {**SIZES, "extra.json": 40}, seed=2)
    outcome: dict[str, Any] = {}

    def x() -> None:
        try:
            outcome["x"] = FsspecSink(s3.url("race"), x_backend).publish(x_export, 7)
        except Exception as e:  # asserted below
            outcome["x"] = e

    t = threading.Thread(target=x)
    t.start()
    try:
        assert x_backend.reached.wait(60)
        gone = [k for k in s3.keys("race/") if k.startswith(f"{STEP7}/") or k.endswith("step-00000007")]
        for key in gone:  # an operator deletes the step, exact keys
            s3.client.delete_object(Bucket=s3.bucket, Key=key)
        w_export = make_export(tmp_path / "w", {**SIZES, "extra.json": 40}, seed=3)
        FsspecSink.from_url(s3.url("race")).publish(w_export, 7)
    finally:
        with caplog.at_level(logging.WARNING, logger="stagerd.sinks.s3"):
            x_backend.release.set()
            t.join(60)
    assert isinstance(outcome["x"], SinkConflictError), outcome["x"]
    assert "extra.json" in {f["path"] for f in _published_intact(s3, STEP7)["files"]}
    assert f"{STEP7}/extra.json" in caplog.text and "stay" in caplog.text


class _Meanwhile(RemoteStore):
    """A prune's store that runs `meanwhile` once, just before the prune's first claim replace."""

    meanwhile: Any = None

    def put_if(self, key: str, data: bytes, tag: str | None) -> str | None:
        if self.meanwhile is not None:
            run, self.meanwhile = self.meanwhile, None
            run()
        return super().put_if(key, data, tag)


def test_a_prune_on_a_store_that_ignores_if_match_refuses_before_changing_anything(s3, tmp_path):  # noqa: F811
    """Steps 1-3 published; a prune (keep the last one) listed them, then, before it took step 1's claim,
    step 1 was deleted by hand (or by another prune). Before the fix its If-Match replace of the claim
    wrote it afresh, and giving it back wrote the old publisher's claim there again: a claim of a step that
    is gone, which refuses every later publish of step 1 until an operator deletes it. Now: a named error
    with a hint, and nothing of the prefix changed."""
    s3.proxy.ignores |= IGNORE_ALL
    sink = FsspecSink.from_url(s3.url("run"))
    for step in (1, 2, 3):
        sink.publish(make_export(tmp_path / f"e{step}", {"model.safetensors": 500}, seed=step), step)
    opened = RemoteStore.open(s3.url("run"))
    store = _Meanwhile(opened.fs, opened.base, opened.url, opened.owns, opened.s3)

    def delete_step_1() -> None:
        for key in [k for k in s3.keys("run/") if "step-00000001" in k]:
            s3.client.delete_object(Bucket=s3.bucket, Key=key)

    store.meanwhile = delete_step_1
    before = s3.keys("run/")
    try:
        with pytest.raises(ConditionsIgnoredError) as refused:
            prune(store, Policy(1, None))
    finally:
        store.close()
    assert "If-Match on PUT" in str(refused.value) and "by hand" in refused.value.hint
    assert not refused.value.retryable
    after = s3.keys("run/")
    assert not [k for k in after if "step-00000001" in k]
    assert {k: v for k, v in before.items() if "step-00000001" not in k} == after


def test_a_user_who_may_not_delete_still_publishes(s3, tmp_path):  # noqa: F811
    """An append-only policy (PutObject, no DeleteObject): the probe's conditional DELETE is a 403. The
    probe takes it as an answer, not a failure, so publishing goes on as before the probe existed."""

    s3.proxy.add(Fault(("DeleteObject",), times=10, status=403, code="AccessDenied"))
    sink = FsspecSink.from_url(s3.url("run"))
    sink.publish(make_export(tmp_path / "e", SIZES, seed=1), 1)
    sink.close()
    _published_intact(s3, "run/step-00000001")


@pytest.mark.parametrize(("status", "code"), [(400, "InvalidArgument"), (405, "MethodNotAllowed")])
def test_a_store_that_refuses_if_match_on_delete_still_publishes(s3, tmp_path, status, code):  # noqa: F811
    """A store that refuses a conditional DELETE it does not support with a client error (not 501). A
    publisher never sent one before the probe; the probe took the refusal for a failure, so every publish
    failed on a store where publishing had worked. It is an answer: nothing was changed."""

    s3.proxy.add(Fault(("DeleteObject",), times=1, status=status, code=code, key_contains="-delete"))
    sink = FsspecSink.from_url(s3.url("run"))
    sink.publish(make_export(tmp_path / "e", SIZES, seed=1), 1)
    sink.close()
    _published_intact(s3, "run/step-00000001")


def test_a_probe_that_fails_leaves_no_scratch_keys(s3, tmp_path):  # noqa: F811
    """A store failing now and then: each failed probe used to leave its two scratch keys, and each retry
    of the publish two more."""

    s3.proxy.add(
        Fault(
            ("PutObject",), times=50, status=409, code="OperationAborted", key_contains=PROBE_PREFIX, after=2
        )
    )
    with pytest.raises(SinkError):
        FsspecSink.from_url(s3.url("run")).publish(make_export(tmp_path / "e", SIZES, seed=1), 1)
    assert s3.proxy.count("PutObject", key_contains=PROBE_PREFIX) > 2  # the probe's conditional PUTs failed
    assert not [k for k in s3.keys("") if PROBE_PREFIX in k]


def test_closing_waits_for_a_probe_no_caller_waits_for_any_more(s3, caplog):  # noqa: F811
    """A missing bucket: the first caller of the probe is cancelled (as a failed gather cancels its
    siblings) while the probe goes on, shielded. Closing the sink left it to fail alone, and its
    NoSuchBucket was printed at exit as a task exception never retrieved."""
    import asyncio
    import gc

    s3.proxy.slow["PutObject"] = 0.5  # the probe's first requests still out when the sink closes
    backend = FsspecSink.from_url(s3.url("run").replace(s3.bucket, "no-such-bucket", 1)).backend
    assert isinstance(backend, S3Backend)

    async def cancelled_caller(b: S3Backend) -> None:
        caller = asyncio.ensure_future(b.conditions())
        await asyncio.sleep(0)  # the probe has started: its first requests are out
        caller.cancel()
        await asyncio.gather(caller, return_exceptions=True)
        assert b._conditions is not None and not b._conditions.done()

    backend._run(cancelled_caller, backend)
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        backend.close()
        del backend
        gc.collect()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()], caplog.text


@pytest.mark.parametrize(
    ("after", "status", "code", "error"),
    [(0, 403, "AccessDenied", SinkAuthError), (2, 409, "OperationAborted", SinkError)],
    ids=["plain-put", "conditional-put"],
)
def test_a_probe_that_fails_names_the_sink_not_its_scratch_key(s3, tmp_path, after, status, code, error):  # noqa: F811
    """The probe is the backend's first request, so its failure is often the first a user sees: it named
    `s3://BUCKET/run/.stagerd-probe-HOST-PID-...-put`, a key nobody chose, instead of the sink."""
    fault = Fault(("PutObject",), times=50, status=status, code=code, key_contains=PROBE_PREFIX, after=after)
    s3.proxy.add(fault)
    with pytest.raises(error) as caught:
        FsspecSink.from_url(s3.url("run")).publish(make_export(tmp_path / "e", SIZES, seed=1), 1)
    assert caught.value.path == s3.url("run"), caught.value
    assert str(caught.value).startswith(f"{s3.url('run')}: {code} (HTTP {status}) from PutObject"), (
        caught.value
    )
    assert "scratch key .stagerd-probe-" in caught.value.message  # the key stays, as the message's detail
    assert not s3.keys("run/step-")  # the probe goes first: nothing of the step was written
