"""The training side without torch: a clear message naming the install, not a bare ImportError."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# sys.modules["torch"] = None makes every `import torch` fail as if torch were not installed.
NO_TORCH = "import sys; sys.modules['torch'] = None\n"


def test_stager_without_torch_names_the_install():
    code = NO_TORCH + (
        "try:\n    from stagerd import Stager\nexcept ModuleNotFoundError as e:\n    print(e.name, e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("torch ")
    assert "pip install 'stagerd[train]'" in proc.stdout


def test_the_package_imports_without_torch():
    code = NO_TORCH + "import stagerd, stagerd.cli; print(stagerd.__version__)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
