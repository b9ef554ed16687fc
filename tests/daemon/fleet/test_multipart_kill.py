"""A fleet export to S3 whose leader is SIGKILLed inside a multipart upload, then again after its manifest,
in a bucket shared with neighbours a loose prefix match would take for its own (`run-1`, `run-10`,
`step-00000070`, `step-000000070`, a flat `step-00000007`, glob and percent names, a folder marker) and
with other prefixes' pending multipart uploads. The restarts finish the single-node export byte for byte,
each file written once, no upload of the step left pending, remote retention takes the older step 1 with
the uploads pending under it, and neither the sweeps, remote retention nor `stagerd prune` touches
anything outside `run/`'s own steps."""

from __future__ import annotations

import json

from stagerd.contract import layout
from stagerd.engine.export import export_step
from stagerd.ops.crashpoints import ENV
from stagerd.sinks.prune import Policy, prune
from stagerd.sinks.remote import RemoteStore
from tests.daemon.fleet.test_daemon import _done, _watch
from tests.daemon.fleet.test_protocol import SHARD, STEP, _keys, _stage, _tree
from tests.s3server import s3, s3_server  # noqa: F401  (fixtures)

STEP_DIR = layout.step_dir_name(STEP)
RETAIN = ("--max-attempts", "5", "--remote-keep-last", "1")  # two kills are two interrupted tries


def _neighbours(env) -> tuple[dict[str, bytes], dict[str, str]]:
    """Objects and pending multipart uploads beside `run/`'s step that no sweep, retention or prune of it
    may touch: key -> bytes, and upload id -> key."""
    objects: dict[str, bytes] = {}
    for prefix in ("run-1", "run-10", "run1", "ru"):  # other runs' complete steps, one the same step
        for step in (1, STEP):
            base = f"{prefix}/{layout.step_dir_name(step)}"
            objects[f"{base}/model.safetensors"] = f"{prefix}@{step}".encode()
            manifest = {"format": layout.MANIFEST_FORMAT, "step": step, "files": [], "metadata": {}}
            objects[f"{base}/{layout.MANIFEST_NAME}"] = json.dumps(manifest).encode()
    for rel in (
        "",  # the folder marker `run/`: the trailing-slash variant of the prefix
        "/x",  # `run//x`
        f"/{STEP_DIR}/model.safetensors",  # `run//step-N/...`
        STEP_DIR,  # a flat object named as the step
        f"{STEP_DIR}0/model.safetensors",  # `step-000000070`: one digit more
        "step-00000070/model.safetensors",
        f"{STEP_DIR}.bak/model.safetensors",
        "step-7/model.safetensors",
        "a*b",
        "[x]",
        "%41",
        "step-0000000?/x",
        "step-.*/x",
        "raw/README",
        f"raw/{STEP_DIR}/node-00000-of-000020/x",
        f"fleet/{STEP_DIR}.bak/done.json",
        "step-00000001",
        "step-00000001.bak/model.safetensors",
        "raw/step-00000001.bak/node-00000-of-00002/x",
        "fleet/step-00000001.bak/done.json",
        "fleet/step-00000001-notes",
    ):
        objects[f"run/{rel}"] = f"person:{rel}".encode()
    for k, v in objects.items():
        env.client.put_object(Bucket=env.bucket, Key=k, Body=v)
    pending = {}
    for key in (
        f"run-1/{STEP_DIR}/model.safetensors",
        f"run10/{STEP_DIR}/model.safetensors",
        f"run/{STEP_DIR}0/model.safetensors",
        f"run/{STEP_DIR}.bak/model.safetensors",
        f"run/{STEP_DIR}",
        f"run/raw/{STEP_DIR}/node-00000-of-00002.bak/x",
        "run/[x]",
    ):
        pending[env.client.create_multipart_upload(Bucket=env.bucket, Key=key)["UploadId"]] = key
    return objects, pending


def _pending(env) -> dict[str, str]:
    return {
        u["UploadId"]: u["Key"]
        for u in env.client.list_multipart_uploads(Bucket=env.bucket).get("Uploads", [])
    }


def _older_step(env) -> list[str]:
    """`run/`'s step 1 as a fleet of an older stagerd left it (no claim: no known publisher, so remote
    retention takes it once step 7 is committed): its export, both node parts and its records."""
    old = layout.step_dir_name(1)
    keys = []
    for base in (old, *(f"raw/{old}/node-0000{k}-of-00002" for k in (0, 1))):
        manifest = {"format": layout.MANIFEST_FORMAT, "step": 1, "files": [], "metadata": {}}
        for name, data in (
            ("model.safetensors", b"old"),
            (layout.MANIFEST_NAME, json.dumps(manifest).encode()),
        ):
            keys.append(f"run/{base}/{name}")
            env.client.put_object(Bucket=env.bucket, Key=keys[-1], Body=data)
    for name in ("node-00000.json", "done.json"):
        keys.append(f"run/fleet/{old}/{name}")
        env.client.put_object(Bucket=env.bucket, Key=keys[-1], Body=b"{}")
    return keys


def _older_uploads(env) -> tuple[dict[str, str], dict[str, str]]:
    """Upload id -> key: what writers killed mid-upload left pending under `run/`'s step 1, which remote
    retention deletes (its export, a node part, a record), and beside it, which no prune of step 1 takes."""
    old = layout.step_dir_name(1)
    under = (
        f"run/{old}/model.safetensors",
        f"run/raw/{old}/node-00001-of-00002/model/__1_0.distcp",
        f"run/fleet/{old}/node-00001.json",
    )
    beside = (
        f"run/{old}0/model.safetensors",  # one digit longer: no step of `run/`
        f"run/raw/{old}0/node-00001-of-00002/x",
        f"run/fleet/{old}.bak/x",
        f"run-1/{old}/model.safetensors",
    )

    def pending(keys: tuple[str, ...]) -> dict[str, str]:
        return {env.client.create_multipart_upload(Bucket=env.bucket, Key=k)["UploadId"]: k for k in keys}

    return pending(under), pending(beside)


def _untouched(env, objects: dict[str, bytes], pending: dict[str, str]) -> None:
    there = _keys(env)
    assert {k: env.get(k) for k in objects if k in there} == objects
    assert {u: k for u, k in _pending(env).items() if u in pending} == pending


def test_a_leader_killed_inside_a_multipart_upload_and_after_its_manifest_leaves_nothing_pending(
    tmp_path,
    dcp_big,
    s3,  # noqa: F811
):
    shared, node_dirs = _stage(tmp_path, dcp_big, 2)
    objects, foreign = _neighbours(s3)
    old = _older_step(s3)
    ours, beside = _older_uploads(s3)
    foreign |= beside
    export_step(shared, max_shard_size=SHARD)  # the single-node export of the same step
    export = shared / layout.EXPORT_DIR
    single = {str(p.relative_to(export)): p.read_bytes() for p in export.rglob("*") if p.is_file()}
    url = s3.url("run")
    other = _watch(node_dirs[1].parent, url + "/", *RETAIN)  # the same sink, spelled with its slash
    # the big file is the leader's (the largest goes to node 0): killed after its first part
    rc, log = _done(_watch(node_dirs[0].parent, url, *RETAIN, env={ENV: "s3.part:1"}))
    assert rc == -9 and "crash point s3.part:1 reached" in log, log
    left = [k for k in _pending(s3).values() if k.startswith(f"run/{STEP_DIR}/")]
    assert left, "the kill left no multipart upload in flight"
    # the restart uploads that file again and commits; killed before `latest` and the sweep after it
    rc, log = _done(_watch(node_dirs[0].parent, url, *RETAIN, env={ENV: "fleet.manifest"}))
    assert rc == -9, log
    (rc0, log0), (rc1, log1) = _done(_watch(node_dirs[0].parent, url, *RETAIN)), _done(other)
    assert (rc0, rc1) == (0, 0), log0 + log1

    assert _tree(_keys(s3), s3, "run") == single and s3.get("run/latest") == STEP_DIR.encode()
    assert not [k for k in _pending(s3).values() if k.startswith(f"run/{STEP_DIR}/")]
    # each file written once: the killed upload never completed, and no restart wrote again a file node 1
    # built or one recorded before the kill (the design redoes only the file a kill interrupted)
    writes: dict[str, int] = {}
    for r in s3.proxy.log:
        name = r.key.partition(f"/run/{STEP_DIR}/")[2]
        if name and r.status == 200 and r.op in ("PutObject", "CompleteMultipartUpload"):
            writes[name] = writes.get(name, 0) + 1
    assert writes == dict.fromkeys([*single, layout.MANIFEST_NAME], 1)
    _untouched(s3, objects, foreign)
    assert not set(old) & set(_keys(s3)), "remote retention did not take the older step"
    assert not set(ours) & set(_pending(s3)), "remote retention left the older step's pending uploads"

    store = RemoteStore.open(url)  # what `stagerd prune URL --keep-last 1` runs
    try:
        assert not [d for d in prune(store, Policy(keep_last=1)) if d.delete]
    finally:
        store.close()
    _untouched(s3, objects, foreign)
    assert _tree(_keys(s3), s3, "run") == single
