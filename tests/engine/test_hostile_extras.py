"""Hostile extras/ (issue 16's red team): a config.json no client can parse is a named error before
anything is written; a huge extra is streamed, never held in memory. (A link out of the step is refused
in tests/engine/test_hostile_input.py.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from stagerd.contract import layout
from tests.cli_helpers import clean_env, run_cli
from tests.dcp_fixtures import commit_step
from tests.export_index import export_index


def _restage(step_dir) -> None:
    (step_dir / layout.MARKER_NAME).unlink()
    commit_step(step_dir, world=4)


@pytest.mark.parametrize(
    ("name", "content", "words"),
    [
        ("config.json", b'{"model_type": "llama",', "not valid JSON"),
        ("config.json", b"[1, 2]", "must hold a JSON object"),
        ("generation_config.json", b"\xff\xfe", "not valid JSON"),
        ("config.json", b"[" * 100_000, "nested too deep"),  # a RecursionError traceback before
    ],
)
def test_an_unparseable_config_is_an_extras_error_and_nothing_is_written(
    step_dir, tmp_path, name, content, words
):
    (step_dir / "extras" / name).write_bytes(content)
    _restage(step_dir)
    r = run_cli(["consolidate", step_dir, tmp_path / "out"])
    assert r.returncode == 2, r.stderr
    assert "ExtrasError" in r.stderr and words in r.stderr and name in r.stderr
    assert not (tmp_path / "out").exists()


def test_a_huge_extra_is_streamed(step_dir, tmp_path):
    big = step_dir / "extras" / "tokenizer.model"
    with open(big, "wb") as f:
        f.truncate(512 << 20)  # sparse: 512 MiB of zeros that take no disk until copied
    _restage(step_dir)
    out = tmp_path / "out"
    code = (
        "import sys\n"
        "from stagerd.cli import main\n"
        f"rc = main(['consolidate', {str(step_dir)!r}, {str(out)!r}])\n"
        # VmHWM belongs to this process's own memory map; ru_maxrss survives exec and would
        # report the parent pytest's peak.
        "hwm = [line for line in open('/proc/self/status') if line.startswith('VmHWM:')]\n"
        "print(hwm[0].split()[1])\n"
        "sys.exit(rc)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    assert (out / "tokenizer.model").stat().st_size == 512 << 20
    peak_mib = int(r.stdout.split()[-1]) >> 10
    assert peak_mib < 256, f"peak RSS {peak_mib} MiB: the extra was read whole"
    assert export_index(out)["weight_map"]


def test_a_config_changed_under_a_held_handle_is_named_by_its_name(tmp_path):
    """The export reads config.json through its held descriptor's /proc/self/fd path: a config rewritten
    since its check said `cannot read 7: Expecting value...`, naming the descriptor, not the file."""
    import os

    from stagerd.engine.hub_config import exported_config
    from stagerd.errors import ExtrasError

    cfg = tmp_path / "config.json"
    cfg.write_bytes(b"{not json")
    fd = os.open(cfg, os.O_RDONLY)
    try:
        with pytest.raises(ExtrasError) as e:
            exported_config(Path(f"/proc/self/fd/{fd}"), {"F32": 16}, "BF16")
    finally:
        os.close(fd)
    assert e.value.message.startswith("cannot read config.json: ")
    assert f"/fd/{fd}" not in e.value.message and f"read {fd}" not in e.value.message
