"""A trainer's own checkpoint given where a staged step is meant (`verify --against`, `consolidate SRC`,
without --adopt) is named as what it is, with --adopt as the way to read it; never with the hint of a
damaged staged step, which says to delete the directory: stagerd did not write it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from stagerd.cli import main


def _hf_checkpoint(path: Path) -> Path:
    path.mkdir(parents=True)
    save_file({"w": torch.zeros(2, 2)}, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text("{}")
    return path


def _dcp_checkpoint(path: Path) -> Path:
    """Only the names matter here: the directory is refused before any file is read."""
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"\0")
    (path / "__0_0.distcp").write_bytes(b"\0")
    return path


def _err(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "delete" not in err and "Traceback" not in err, err
    return err


def test_verify_against_a_trainers_hf_checkpoint_points_to_adopt(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = _hf_checkpoint(tmp_path / "outputs" / "checkpoint-300")
    export = _hf_checkpoint(tmp_path / "hf-300")
    err = _err(["verify", str(export), "--against", str(ckpt)], capsys)
    assert "--against is already a Hugging Face export or checkpoint" in err, err
    assert f"--against {ckpt} --adopt`" in err, err


@pytest.mark.parametrize("command", ["verify", "consolidate"])
def test_a_trainers_dcp_checkpoint_without_adopt_is_not_to_be_deleted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    ckpt = _dcp_checkpoint(tmp_path / "outputs" / "checkpoint-300" / "pytorch_model_fsdp_0")
    if command == "verify":
        argv = ["verify", str(_hf_checkpoint(tmp_path / "hf-300")), "--against", str(ckpt)]
    else:
        argv = ["consolidate", str(ckpt), str(tmp_path / "out")]
    err = _err(argv, capsys)
    assert "ShardError" in err and "read with --adopt" in err, err
    assert not (tmp_path / "out").exists()


def test_an_adopted_checkpoint_missing_a_file_is_not_to_be_deleted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch.distributed.checkpoint as dcp

    ckpt = tmp_path / "outputs" / "checkpoint-300"
    dcp.save({"model": {"w": torch.zeros(2, 2)}}, checkpoint_id=str(ckpt))
    for data in ckpt.glob("*.distcp"):
        data.unlink()
    err = _err(["consolidate", str(ckpt), str(tmp_path / "out"), "--adopt", "dcp"], capsys)
    assert "ShardError" in err and "not a whole checkpoint as --adopt reads it" in err, err
