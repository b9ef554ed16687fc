"""`layout.write_bytes_atomic` (markers, manifests, `latest`, the lock's neighbours): its temp name is
predictable, so whatever already has that name is replaced, never written through."""

from __future__ import annotations

import os
import threading

from stagerd.contract import layout


def test_a_link_at_the_temp_name_is_never_written_through(tmp_path):
    victim = tmp_path / "elsewhere.txt"
    victim.write_bytes(b"not stagerd's")
    path = tmp_path / "root" / "stagerd.commit.json"
    path.parent.mkdir()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    tmp.symlink_to(victim)  # before: truncated and written through, then the link renamed over `path`
    layout.write_bytes_atomic(path, b"{}\n")
    assert victim.read_bytes() == b"not stagerd's"
    assert path.read_bytes() == b"{}\n" and not path.is_symlink() and not tmp.exists()


def test_a_dead_writers_temp_file_of_the_same_name_is_replaced(tmp_path):
    path = tmp_path / "latest"
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    tmp.write_bytes(b"x" * 100)
    layout.write_bytes_atomic(path, b"step-00000001")
    assert path.read_bytes() == b"step-00000001" and not tmp.exists()
