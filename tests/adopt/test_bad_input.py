"""Bad checkpoints under an adopted ROOT: each is a named error and one line in `status`, nothing of it is
published, and the good checkpoints beside it go on. Also a daemon killed in the middle of an adopted
export resumes it and publishes the step exactly once."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest

from stagerd.contract.adopt.dcp_metadata import parse_dcp_metadata
from stagerd.errors import DcpFormatError
from tests.adopt import ranks
from tests.adopt.helpers import published, tree_digest, watch_once
from tests.cli_helpers import run_cli

EVIL = b"cos\nsystem\n(S'touch /tmp/stagerd-pwned'\ntR."


def _titan(path: Path, extra: bool) -> None:
    """A torchtitan-named state dict (one layer), with an extra tensor no preset maps when `extra`."""
    import torch
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(1)
    shapes = {
        "tok_embeddings.weight": (16, 8),
        "layers.0.attention.qkv_linear.wq.weight": (8, 8),
        "layers.0.attention.qkv_linear.wk.weight": (4, 8),
        "layers.0.attention.qkv_linear.wv.weight": (4, 8),
        "layers.0.attention.wo.weight": (8, 8),
        "layers.0.feed_forward.w1.weight": (12, 8),
        "layers.0.feed_forward.w2.weight": (8, 12),
        "layers.0.feed_forward.w3.weight": (12, 8),
        "layers.0.attention_norm.weight": (8,),
        "layers.0.ffn_norm.weight": (8,),
        "norm.weight": (8,),
        "lm_head.weight": (16, 8),
    }
    if extra:
        shapes["layers.0.attention.sinks"] = (2,)
    state = {k: torch.randn(*s, generator=g) for k, s in shapes.items()}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad") / "root"
    ranks.write(str(root / "step-1"))
    for n in (2, 3, 4, 6):
        shutil.copytree(root / "step-1", root / f"step-{n}")
    (root / "step-2" / ".metadata").write_bytes((root / "step-2" / ".metadata").read_bytes()[:100])
    (root / "step-3" / ".metadata").write_bytes(EVIL)
    next((root / "step-4").glob("*.distcp")).unlink()
    shutil.copytree(root / "step-1", root / "step_6")  # a second directory for step 6
    _titan(root / "step-7", extra=False)
    _titan(root / "step-8", extra=True)
    cfg = {"model_type": "llama", "num_attention_heads": 2, "num_key_value_heads": 1, "hidden_size": 8}
    (root / "config.json").write_text(json.dumps(cfg))
    return root


def test_each_bad_checkpoint_is_a_named_error_and_the_good_ones_are_published(root, tmp_path):
    before = tree_digest(root)
    res = watch_once(root, tmp_path / "out")
    assert res.returncode != 0
    assert "2 step(s) published, 5 not" in res.stdout, res.stdout + res.stderr
    assert published(tmp_path / "out", 1).is_dir() and published(tmp_path / "out", 7).is_dir()
    assert not Path("/tmp/stagerd-pwned").exists()
    status = run_cli(["status", root]).stdout
    rows = [ln.split() for ln in status.splitlines() if ln.strip()[:1].isdigit()]
    lines = {int(r[0]): " ".join(r) for r in rows if r[1] in ("published", "quarantined")}
    want = {2: "DcpFormatError", 3: "DcpFormatError", 4: "ShardError", 6: "AdoptError", 8: "HubPlanError"}
    for step, error in want.items():
        assert "quarantined" in lines[step] and error in lines[step], (step, lines[step])
        assert not published(tmp_path / "out", step).exists()
    assert "refusing to unpickle os.system" in res.stdout + res.stderr
    assert tree_digest(root) == before


def test_the_allowlist_refuses_any_other_global_without_running_it():
    with pytest.raises(DcpFormatError, match=r"refusing to unpickle os\.system"):
        parse_dcp_metadata(EVIL, "x")
    with pytest.raises(DcpFormatError, match=r"builtins\.eval"):
        parse_dcp_metadata(pickle.dumps(eval), "x")
    with pytest.raises(DcpFormatError, match="not DCP's Metadata"):
        parse_dcp_metadata(pickle.dumps({"a": 1}), "x")
    assert not Path("/tmp/stagerd-pwned").exists()


def test_a_daemon_killed_mid_export_resumes_and_publishes_once(tmp_path):
    root = tmp_path / "root"
    ranks.write(str(root / "step-1"))
    first = watch_once(root, tmp_path / "out", env={"STAGERD_CRASH_AT": "export.move"})
    assert first.returncode == -9, first.stdout + first.stderr
    assert not published(tmp_path / "out", 1).exists()
    again = watch_once(root, tmp_path / "out")
    assert again.returncode == 0 and "1 step(s) published, 0 not" in again.stdout, again.stdout
    assert "resumed after a crash" in again.stdout + again.stderr
