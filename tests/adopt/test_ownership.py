"""The trainer owns its checkpoints: `--keep-last` removes only stagerd's exports of old published steps,
unless `--delete-adopted` turns local retention of the trainer's checkpoints on; the export is refused a
place inside a checkpoint."""

from __future__ import annotations

import shutil

from tests.adopt import ranks
from tests.adopt.helpers import published, tree_digest, watch_once


def test_keep_last_deletes_a_trainers_checkpoint_only_when_asked(tmp_path):
    root = tmp_path / "root"
    ranks.write(str(root / "step-1"))
    shutil.copytree(root / "step-1", root / "step-2")
    before = tree_digest(root)
    res = watch_once(root, tmp_path / "out", "--keep-last", "1")
    assert res.returncode == 0 and "2 step(s) published" in res.stdout, res.stdout + res.stderr
    assert tree_digest(root) == before  # both checkpoints kept, byte for byte
    adopted = root / ".stagerd" / "adopted"
    assert not (adopted / "step-1").exists() and (adopted / "step-2" / "export").is_dir()

    ranks.write(str(root / "step-3"))
    res = watch_once(root, tmp_path / "out", "--keep-last", "1", "--delete-adopted")
    assert res.returncode == 0, res.stdout + res.stderr
    # step-2 was live and is now beyond keep-last: deleted; step-1 was retired by the first run, without
    # the flag, and stays the trainer's
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step")) == ["step-1", "step-3"]
    assert all(published(tmp_path / "out", s).is_dir() for s in (1, 2, 3))


def test_an_export_directory_inside_a_checkpoint_is_refused(tmp_path):
    root = tmp_path / "root"
    ranks.write(str(root / "step-1"))
    res = watch_once(root, tmp_path / "out", "--export-dir", str(root / "step-1" / "hf"))
    assert res.returncode == 2 and "inside the trainer's checkpoint step-1" in res.stderr, res.stderr
    assert not (root / "step-1" / "hf").exists()
