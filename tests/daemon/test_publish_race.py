"""Two daemons, on two ROOTs holding different weights of one shape, publish step 7 to one S3 prefix at
once: a job restarted on another node while the old daemon still publishes, or two experiments sharing a
prefix. The race is widened with a delay point: daemon Y opens the step, then waits; daemon X publishes
meanwhile. Exactly one wins and its manifest describes the bytes on S3; the other changed nothing and says
why. (Before the fix X reported "published" while Y's re-upload later replaced X's model file under X's
manifest.)
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from pathlib import Path

from stagerd.contract import layout
from tests.cli_helpers import STAGERD, clean_env, run_cli
from tests.daemon_helpers import fast_flags, stage_copy
from tests.s3server import s3, s3_server  # noqa: F401  (fixtures)


def _other_weights(step_dir: Path) -> None:
    """The same tensors, names and sizes, other values: one byte of the last tensor's data flipped."""
    shard = sorted((step_dir / "model").glob("*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01
    shard.write_bytes(bytes(data))


def test_two_daemons_publishing_one_step_end_with_one_winner(tmp_path, dcp_mixed2, s3):  # noqa: F811
    roots = {name: tmp_path / name for name in ("x", "y")}
    for name, root in roots.items():
        step_dir = stage_copy(root, 7, dcp_mixed2[0], 2)
        if name == "y":
            _other_weights(step_dir)
    url = s3.url("race")
    flags = ["--sink", url, "--once", "--max-attempts", "2", *fast_flags()]
    go_on = tmp_path / "go-on"
    env = clean_env(
        {
            "STAGERD_DELAY_AT": "publish.opened:120",
            "STAGERD_DELAY_RELEASE": str(go_on),
            "STAGERD_RETRY_BASE_SECONDS": "0.1",
        }
    )
    y = subprocess.Popen(
        [*STAGERD, "watch", str(roots["y"]), *flags], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        seen = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any("delay point publish.opened" in s for s in seen):
            line = y.stderr.readline()
            assert line or y.poll() is None, "".join(seen)[-3000:]
            seen.append(line)
        x = run_cli(["watch", roots["x"], *flags], env={"STAGERD_RETRY_BASE_SECONDS": "0.1"}, timeout=120)
    finally:
        go_on.touch()
        out = y.communicate(timeout=120)[1]
    assert y.returncode == 0, out[-3000:]
    assert x.returncode == 1 and "StepClaimedError" in x.stderr, x.stderr[-3000:]

    # the winner's manifest describes every byte under the step, and those are Y's export
    base = f"race/{layout.step_dir_name(7)}"
    manifest = json.loads(s3.get(f"{base}/{layout.MANIFEST_NAME}"))
    export = roots["y"] / layout.step_dir_name(7) / layout.EXPORT_DIR
    for f in manifest["files"]:
        data = s3.get(f"{base}/{f['path']}")
        assert hashlib.sha256(data).hexdigest() == f["sha256"], f["path"]
        assert data == (export / f["path"]).read_bytes(), f["path"]
    assert s3.get("race/latest") == layout.step_dir_name(7).encode()
    r = run_cli(["status", roots["x"], "--json"])
    lanes = json.dumps(json.loads(r.stdout))
    assert "StepClaimedError" in lanes, lanes[-2000:]
