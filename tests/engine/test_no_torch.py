"""The daemon's commands never import torch (issue 15): the sidecar ships without it.

Each command runs in a subprocess where `import torch` finds a stand-in that records the attempt and fails,
so a command that only *tried* torch (and caught the ImportError) is caught too. The export casts to bf16,
so the cast kernel is on the path.
"""

from __future__ import annotations

import shutil

import pytest

from stagerd.contract import layout
from tests.cli_helpers import REPO, run_cli

BLOCKER = """import os, traceback
with open(os.environ["TORCH_IMPORTED"], "a") as f:
    f.write("".join(traceback.format_stack()))
raise ImportError("torch is not installed in this test (the daemon must not need it)")
"""


@pytest.fixture
def no_torch(tmp_path):
    site = tmp_path / "no_torch_site"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text(BLOCKER)
    touched = tmp_path / "torch_imported.txt"
    env = {"PYTHONPATH": f"{site}:{REPO}", "TORCH_IMPORTED": str(touched)}

    def run(*args: object) -> str:
        r = run_cli([str(a) for a in args], env=env, timeout=300)
        assert not touched.exists(), f"stagerd {args[0]} imported torch:\n{touched.read_text()}"
        assert r.returncode == 0, f"stagerd {args[0]}: {r.stdout}{r.stderr}"
        return r.stdout

    return run


def test_daemon_commands_never_import_torch(no_torch, step_dir, tmp_path):
    out = tmp_path / "consolidated"
    no_torch("consolidate", "--dtype", "bf16", step_dir, out)
    no_torch("verify", "--against", step_dir, out)
    no_torch("publish", "--sink", f"file://{tmp_path / 'published'}", "--step", 100, out)
    root = tmp_path / "root"
    root.mkdir()
    shutil.move(step_dir, root / step_dir.name)
    watched = f"file://{tmp_path / 'watched'}"
    no_torch(
        "watch",
        "--once",
        "--dtype",
        "bf16",
        "--publish-raw",
        "--remote-keep-last",
        "1",
        "--sink",
        watched,
        root,
    )
    assert (root / step_dir.name / layout.EXPORT_DIR / layout.WEIGHTS_NAME).is_file()
    no_torch("status", root)
    no_torch("restore", watched, tmp_path / "restored")  # issue 13's commands too
    no_torch("prune", watched, "--keep-last", "1", "--dry-run")


def test_adopting_a_trainers_checkpoint_never_imports_torch(no_torch, tmp_path):
    """`.metadata` and the `torch.save` records are read by stagerd's own allowlists, not by torch."""
    from tests.adopt import ranks

    root = tmp_path / "root"
    ranks.write(str(root / "step-5"))
    no_torch("watch", "--once", "--adopt", "--dtype", "bf16", "--sink", f"file://{tmp_path / 'out'}", root)
    no_torch(
        "verify", root / ".stagerd" / "adopted" / "step-5" / "export", "--against", root / "step-5", "--adopt"
    )
