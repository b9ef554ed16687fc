"""`Stager.save` arguments in one process (no torch.distributed): a named error, nothing written."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from stagerd.contract import commit_marker, layout
from stagerd.errors import ConfigError, DTypeError, ReferenceIndexError, SaveInputError, StepExistsError


def test_single_process_save_and_bad_arguments(tmp_path):
    from stagerd import Stager

    sd = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    with Stager(tmp_path) as stager:
        assert stager.world_size == 1 and stager.topology.shared
        with pytest.raises(SaveInputError, match=r"'model\.flag' is a bool"):
            stager.save({"model": {"flag": True}}, 1)
        with pytest.raises(DTypeError):
            stager.save(sd, 1, dtype="int3")
        with pytest.raises(SaveInputError, match="not a readable file"):
            stager.save(sd, 1, extras={"config.json": str(tmp_path / "missing.json")})
        with pytest.raises(SaveInputError, match="escapes"):
            stager.save(sd, 1, extras={"../x.json": {}})
        with pytest.raises(ReferenceIndexError):
            stager.save(sd, 1, reference_index=tmp_path / "nope.json")
        assert not (tmp_path / "step-00000001").exists()  # a refused save writes nothing
        marker = stager.save(sd, 1, dtype="fp16").result()
        assert marker.files[0].path == "model/shard-00001-model-00001-of-00001.safetensors"
        assert marker.dtype == "fp16" and marker.tensors == {"w": commit_marker.TensorInfo("F32", (2, 3))}
        with pytest.raises(StepExistsError):
            stager.save(sd, 1)
    with safe_open(tmp_path / "step-00000001" / marker.files[0].path, "pt") as f:
        assert torch.equal(f.get_tensor("w"), sd["w"])


def test_reference_index_is_checked_by_the_contract_at_save(tmp_path):
    from stagerd import Stager

    sd = {"w": torch.zeros(2)}
    not_json = tmp_path / "broken.json"
    not_json.write_text("{")
    no_map = tmp_path / "no-map.json"
    no_map.write_text('{"metadata": {}}')
    good = tmp_path / "model.safetensors.index.json"
    good.write_text(json.dumps({"weight_map": {"w": "model.safetensors"}}))
    root = tmp_path / "root"
    with Stager(root) as stager:
        for bad in (not_json, no_map, tmp_path, {}, {"weight_map": {"w": ""}}, {"w": 1}, 3):
            with pytest.raises(ReferenceIndexError):
                stager.save(sd, 1, reference_index=bad)
        assert not (root / "step-00000001").exists()
        # The weight_map itself goes into the marker, never the trainer's path (issue 19, item 9).
        assert stager.save(sd, 1, reference_index=good).result().reference_index == {"w": "model.safetensors"}
        mapping = {"weight_map": {"w": "model.safetensors"}, "metadata": {"total_size": 8}}
        marker = stager.save(sd, 2, reference_index=mapping).result()
        assert marker.reference_index == {"w": "model.safetensors"}


def test_a_marker_naming_a_reference_index_outside_its_step_is_refused(step_dir, tmp_path):
    """Issue 19, item 9: a path outside the step could be a FIFO (the export hung on every restart), a
    huge file read whole, or a file only the trainer's container sees."""
    from stagerd.contract import layout
    from stagerd.engine.export import export_step

    outside = tmp_path / "index.json"
    outside.write_text(json.dumps({"weight_map": {}}))
    marker = json.loads((step_dir / layout.MARKER_NAME).read_text())
    for ref in (str(outside), "../index.json"):
        (step_dir / layout.MARKER_NAME).write_text(json.dumps({**marker, "reference_index": ref}))
        with pytest.raises(ReferenceIndexError, match="outside the step"):
            export_step(step_dir)
        assert not (step_dir / layout.EXPORT_DIR).exists()


def test_a_step_directory_that_is_a_link_is_never_cleared_or_written_through(tmp_path):
    """A link named like an uncommitted step in ROOT (to another run's directory, another disk): the save
    used to clear `model/`, `optim/` and `extras/` of the link's target, outside ROOT, and write there."""
    from stagerd import Stager
    from stagerd.errors import SaveError

    other = tmp_path / "other-run"
    for d in ("model", "optim", "extras"):
        (other / d).mkdir(parents=True)
        (other / d / "keep.bin").write_bytes(b"not stagerd's")
    root = tmp_path / "root"
    root.mkdir()
    (root / "step-00000001").symlink_to(other, target_is_directory=True)
    (root / "step-00000002").mkdir()
    (root / "step-00000002" / "model").symlink_to(other / "model", target_is_directory=True)
    sd = {"w": torch.arange(4, dtype=torch.float32)}
    with Stager(root) as stager:
        for step, link in ((1, root / "step-00000001"), (2, root / "step-00000002" / "model")):
            with pytest.raises(SaveError, match="SymlinkError") as err:
                stager.save(sd, step).result()
            assert str(link) in str(err.value)
        with pytest.raises(SaveError):  # wait() reports the failed saves again
            stager.wait()
        assert stager.save(sd, 3).result().step == 3  # other steps go on
    assert sorted(p.relative_to(other).as_posix() for p in other.rglob("*")) == [
        "extras",
        "extras/keep.bin",
        "model",
        "model/keep.bin",
        "optim",
        "optim/keep.bin",
    ]
    assert (other / "model" / "keep.bin").read_bytes() == b"not stagerd's"


def test_a_new_save_into_an_uncommitted_step_never_keeps_the_old_export(tmp_path):
    """A step whose marker went first (an interrupted `rm -rf`, a marker deleted by hand) is uncommitted:
    the next save cleared model/, optim/ and extras/ but kept the daemon's export/ of the old save, which
    the export engine then took as this save's (same options: `skipped`), so the old weights were
    published as the new save."""
    from stagerd import Stager
    from stagerd.engine.export import export_step

    step = tmp_path / "step-00000001"
    with Stager(tmp_path) as stager:
        stager.save({"w": torch.zeros(4)}, 1).result()
        assert not export_step(step).skipped
        (step / layout.MARKER_NAME).unlink()
        stager.save({"w": torch.ones(4)}, 1).result()
    again = export_step(step)
    assert not again.skipped
    (shard,) = (step / layout.EXPORT_DIR).glob("*.safetensors")
    with safe_open(shard, "pt") as f:
        assert torch.equal(f.get_tensor("w"), torch.ones(4))


def test_a_plain_state_dict_is_sharded_in_its_own_order(tmp_path):
    """Without a model, the export fills its files in the order the state dict was saved, as
    huggingface_hub's `save_torch_state_dict` of it does (its oversized tensor in a file of its own,
    ahead). Before: the marker listed the tensors sorted, and the export packed in natural order."""
    from huggingface_hub import split_torch_state_dict_into_shards

    from stagerd import Stager
    from stagerd.engine.export import export_step
    from tests.export_index import export_index

    g = torch.Generator().manual_seed(0)
    sd = {
        name: torch.randn(n, generator=g)
        for name, n in (("z", 40), ("layers.10.w", 90), ("a", 30), ("b", 20))
    }
    with Stager(tmp_path) as stager:
        marker = stager.save(sd, 1).result()
    assert list(marker.tensors or {}) == list(sd)
    export = export_step(tmp_path / layout.step_dir_name(1), max_shard_size=300).export_dir
    theirs = split_torch_state_dict_into_shards(sd, max_shard_size=300)
    assert export_index(export)["weight_map"] == theirs.tensor_to_filename


def test_optimizer_values_a_resume_cannot_read_back_are_refused_at_save(tmp_path):
    """The optimizer state's non-tensor leaves are read back with `torch.load(weights_only=True)`: a
    `Path`, an object or numpy's RNG state was once committed, and only the resume failed, with an
    `UnpicklingError` (a meta or complex128 tensor failed after save() returned; a lazy conjugate or
    negative view was committed with its storage's values, not its own). Now save() refuses each, naming
    it, and numpy arrays and scalars load back as numpy."""
    import pathlib
    import random

    import numpy as np

    from stagerd import Stager

    sd = {"w": torch.ones(2)}
    rng = np.random.RandomState(3).get_state()
    saved = {"np": rng, "scalar": np.float32(1.5), "py": random.Random(4).getstate(), "lr": 0.1}
    with Stager(tmp_path) as stager:
        for bad, match in [
            ({"p": pathlib.Path("/data")}, r"value 'p' is a PosixPath.*refuses pathlib\.PosixPath"),
            ({"g": [{"fn": lambda: 1}]}, r"value 'g\.0\.fn' is a function"),
            ({"m": torch.empty(3, device="meta")}, r"entry 'm' is a meta tensor"),
            ({"c": torch.ones(2, dtype=torch.complex128)}, r"entry 'c' is torch\.complex128"),
        ]:
            with pytest.raises(SaveInputError, match=match):
                stager.save(sd, 1, optimizer_state=bad)
        with pytest.raises(SaveInputError, match=r"model state dict entry 'z' is torch\.complex128"):
            stager.save({"z": torch.ones(1, dtype=torch.complex128)}, 1)
        # a lazy view's storage holds the values before it: it saved them, silently
        with pytest.raises(SaveInputError, match=r"entry 'c' is a lazy conjugate view"):
            stager.save({"c": torch.tensor([1 + 2j], dtype=torch.complex64).conj()}, 1)
        with pytest.raises(SaveInputError, match=r"entry 'n' is a lazy negative view"):
            stager.save(sd, 1, optimizer_state={"n": torch._neg_view(torch.ones(2))})
        assert not (tmp_path / "step-00000001").exists()
        stager.save(sd, 1, optimizer_state=saved).result()
        got = {"np": None, "scalar": None, "py": None, "lr": None}
        stager.load({"w": torch.zeros(2)}, got)
    assert got["np"][0] == "MT19937" and np.array_equal(got["np"][1], rng[1]) and got["np"][2:] == rng[2:]
    assert type(got["scalar"]) is np.float32 and got["scalar"] == 1.5
    assert got["py"] == saved["py"] and got["lr"] == 0.1


def test_a_root_that_cannot_be_a_directory_is_a_named_error(tmp_path):
    """A ROOT naming a file, or under one, was a bare FileExistsError / NotADirectoryError."""
    from stagerd import Stager

    (tmp_path / "file").write_text("")
    for root in (tmp_path / "file", tmp_path / "file" / "ckpt"):
        with pytest.raises(ConfigError, match="cannot use it as the Stager's root") as e:
            Stager(root)
        assert e.value.path == str(root)


def test_a_config_extra_is_json_text_or_the_config_object_itself(tmp_path):
    """The own loop's `extras={"config.json": model_config}`: JSON text (`cfg.to_json_string()`) is JSON,
    not a path; `model.config` itself is saved as save_pretrained writes it; the plan reads either. A
    value of no such kind says what an extra may be, not what a state dict may be."""
    import transformers as tf

    from stagerd import Stager
    from stagerd.training.config_model import config_dict

    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1)
    sd = {"w": torch.ones(2)}
    with Stager(tmp_path / "root") as stager:
        stager.save(sd, 1, extras={"config.json": cfg.to_json_string(), "object.json": cfg}).result()
        for bad, said in (
            ("{" + "x" * 400, "starts as JSON text but does not parse"),
            ("x" * 400, "is not a file path|is not a readable file"),
            (7, "extras 'config.json': a int cannot be saved as a file"),
        ):
            with pytest.raises(SaveInputError, match=said) as e:
                stager.save(sd, 2, extras={"config.json": bad})
            assert "model.config" in e.value.hint and "state dict" not in e.value.hint
    extras = tmp_path / "root" / layout.step_dir_name(1) / layout.EXTRAS_DIR
    assert (extras / "config.json").read_text() == cfg.to_json_string()
    cfg.save_pretrained(tmp_path / "ref")
    assert (extras / "object.json").read_bytes() == (tmp_path / "ref" / "config.json").read_bytes()
    assert config_dict(cfg.to_json_string())["model_type"] == config_dict(cfg)["model_type"] == "llama"
