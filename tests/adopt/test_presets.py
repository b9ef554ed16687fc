"""Step names, presets and the record reader, without a daemon: each rule of the adoption contract alone."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from stagerd.contract.adopt.presets import PRESETS, get_preset, resolve_selection, select_keys
from stagerd.contract.adopt.step_names import compile_step_regex, parse_step_name
from stagerd.contract.key_mapping import KeyMapping
from stagerd.errors import AdoptError, ConfigError, DcpFormatError, HubPlanError

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("name", "step"),
    [
        ("step-300", 300),
        ("step_300", 300),
        ("checkpoint-300", 300),
        ("global_step_300", 300),
        ("global_step300", 300),
        ("epoch_2_step_300", 300),
        ("epoch=2-step=300.ckpt", 300),
        ("epoch=2-step=300-v1.ckpt", 300),
        ("epoch=2-step=300", 300),
        ("epoch_0_step_2.reserving-1a2b", None),  # AutoModel's directory before it is published
        ("step-300.tmp", None),
        ("latest", None),
        ("last.ckpt", None),
        ("step-٣", None),  # not ASCII digits
    ],
)
def test_step_numbers_come_from_the_names_trainers_write(name, step):
    assert parse_step_name(name) == step


def test_an_operators_step_regex_comes_first_and_needs_a_group():
    rx = compile_step_regex(r"ckpt_(?P<step>\d+)_final")
    assert parse_step_name("ckpt_12_final", rx) == 12 and parse_step_name("step-3", rx) == 3
    with pytest.raises(ConfigError, match="no group"):
        compile_step_regex(r"ckpt_\d+")


def test_selection_takes_the_model_and_names_it():
    keys = ["model.model.embed_tokens.weight", "model.lm_head.weight", "optimizer.state.x.exp_avg"]
    assert select_keys(PRESETS["hf-trainer"], keys) == {
        "model.embed_tokens.weight": "model.model.embed_tokens.weight",
        "lm_head.weight": "model.lm_head.weight",
    }
    assert select_keys(PRESETS["dcp"], ["w", "b"]) == {"w": "w", "b": "b"}  # no `model.`: every key
    with pytest.raises(AdoptError, match="would both be"):
        select_keys(PRESETS["dcp"], ["model.a.w", "ema.a.w"], r"(?:model|ema)\.(.+)")
    with pytest.raises(AdoptError, match="selects no tensor"):
        select_keys(PRESETS["hf-trainer"], ["optimizer.state.x"])


def test_a_selection_of_nothing_hints_at_a_regex_that_works():
    """A LightningModule holding its model as `self.net`: the hint's own example selects it."""
    keys = ["state_dict.net.layer.weight", "state_dict.net.layer.bias", "optimizer_states.0.state"]
    with pytest.raises(AdoptError, match="selects no tensor") as e:
        select_keys(PRESETS["hf-trainer"], keys)
    example = e.value.hint.split("e.g. '", 1)[1].split("'", 1)[0]
    assert select_keys(PRESETS["hf-trainer"], keys, example) == {
        "layer.weight": "state_dict.net.layer.weight",
        "layer.bias": "state_dict.net.layer.bias",
    }
    with pytest.raises(AdoptError, match=r"--adopt-select .*nope.* selects no tensor"):
        select_keys(PRESETS["hf-trainer"], keys, r"nope\.(.+)")


def test_a_tied_head_is_left_out_as_save_pretrained_does():
    shapes = {"model.model.embed_tokens.weight": (8, 4), "model.lm_head.weight": (8, 4)}
    keys, plan = resolve_selection(PRESETS["hf-trainer"], shapes, config={"tie_word_embeddings": True})
    assert keys == ["model.model.embed_tokens.weight"]
    assert [v.name for v in plan.views] == ["model.embed_tokens.weight"]
    keys, _ = resolve_selection(PRESETS["hf-trainer"], shapes, config={"tie_word_embeddings": False})
    assert len(keys) == 2


def test_torchtitan_needs_its_head_counts_from_config_and_maps_every_model_key():
    shapes = {"tok_embeddings.weight": (16, 8), "layers.0.attention.qkv_linear.wq.weight": (8, 8)}
    with pytest.raises(HubPlanError, match="num_attention_heads"):
        resolve_selection(PRESETS["torchtitan"], shapes, config={})
    keys, plan = resolve_selection(PRESETS["torchtitan"], {**shapes, "optimizer.state.x": (2,)}, config={
        "num_attention_heads": 2
    })  # fmt: skip
    assert "optimizer.state.x" not in keys
    q = next(v for v in plan.views if v.name == "model.layers.0.self_attn.q_proj.weight")
    assert q.perm == (0, 2, 1, 3) and q.reshape == (2, 2, 2, 8)
    with pytest.raises(HubPlanError, match="unmapped"):
        resolve_selection(PRESETS["torchtitan"], {**shapes, "layers.0.sinks": (2,)}, config={
            "num_attention_heads": 2
        })  # fmt: skip


def test_the_torchtitan_preset_agrees_with_the_shipped_example():
    """examples/torchtitan_llama_to_hf.json maps torchtitan 0.3's names and earlier releases' as the preset
    does."""
    example = json.loads((REPO / "examples" / "torchtitan_llama_to_hf.json").read_text())
    parts = ["attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1"]
    parts += ["feed_forward.w2", "feed_forward.w3", "attention_norm", "ffn_norm"]
    parts += ["attention.qkv_linear.wq", "attention.qkv_linear.wk", "attention.qkv_linear.wv"]
    names = [
        "tok_embeddings.weight",
        "norm.weight",
        "output.weight",
        "lm_head.weight",
        *(f"layers.3.{n}.weight" for n in parts),
    ]
    preset_rules = PRESETS["torchtitan"].mapping["rules"]  # type: ignore[index]
    for key in names:
        want = next(r for r in example["rules"] if re.fullmatch(r["match"], key))
        got = next(r for r in preset_rules if re.fullmatch(r["match"], key))
        assert re.fullmatch(got["match"], key).expand(got["name"]) == re.fullmatch(want["match"], key).expand(
            want["name"]
        )
        assert ("rope_heads" in got) == ("rope_heads" in want), key
    KeyMapping.load(example)


def test_an_unknown_preset_is_a_config_error():
    with pytest.raises(ConfigError, match="no adopt preset") as e:
        get_preset("megatron")
    assert "did you mean" not in str(e.value.hint)


def test_watch_names_the_closest_preset_or_the_swallowed_root(tmp_path):
    """`--adopt hf_trainer` gets the preset meant; `--adopt ROOT` (its PRESET is optional, so it takes
    ROOT) is told to put ROOT first. Said before anything is written."""
    from tests.cli_helpers import run_cli

    sink = ["--sink", (tmp_path / "sink").as_uri(), "--once"]
    typo = run_cli(["watch", tmp_path, "--adopt", "hf_trainer", *sink])
    assert typo.returncode == 2 and "no adopt preset 'hf_trainer'" in typo.stderr, typo.stderr
    assert "did you mean hf-trainer?" in typo.stderr, typo.stderr
    swallowed = run_cli(["watch", "--adopt", tmp_path, *sink])
    assert swallowed.returncode == 2 and "it took ROOT as one: put ROOT first" in swallowed.stderr
    assert not (tmp_path / ".stagerd").exists() and not (tmp_path / "sink").exists()


def test_a_record_that_is_not_torch_save_is_refused_by_name(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    from stagerd.engine.adopt.source import open_adopted
    from stagerd.engine.consolidate import plan

    writer = FileSystemWriter(tmp_path / "ck", serialization_format=SerializationFormat.SAFETENSORS)
    dcp.save({"model": {"w": torch.ones(4, 4)}}, storage_writer=writer, no_dist=True)
    source = open_adopted(tmp_path / "ck")
    with pytest.raises(DcpFormatError, match=r"not a torch\.save archive"):
        plan(source.scan())


def _changing(tmp_path, change):
    """export_adopted of a small checkpoint, `change(ckpt)` run from inside the export's first progress."""
    from stagerd.engine.adopt.export import export_adopted
    from tests.adopt import ranks

    ckpt = tmp_path / "step-1"
    ranks.write(str(ckpt))
    done = []

    def progress(_done: int, _total: int) -> None:
        if not done:
            done.append(change(ckpt))

    work = tmp_path / "work"
    return work, lambda: export_adopted(ckpt, work, progress=progress)


def test_a_checkpoint_saved_again_or_deleted_during_its_export_is_never_exported(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    from stagerd.errors import SourceChangedError

    other = tmp_path / "other"  # the next save, written in place over the first one file by file
    dcp.save({"model": {"w": torch.zeros(8, 4), "b": torch.zeros(8)}}, checkpoint_id=str(other), no_dist=True)

    def resave(ckpt):
        for f in sorted(other.iterdir(), key=lambda p: p.name == ".metadata"):  # data first, as DCP does
            shutil.copyfile(f, ckpt / f.name)

    for name, change in (("resaved", resave), ("deleted", shutil.rmtree)):
        work, run = _changing(tmp_path / name, change)
        with pytest.raises(SourceChangedError):
            run()
        assert not (work / "export").exists() and not (work / "export.tmp").exists()


def test_hf_shards_are_finished_when_the_trainers_incomplete_file_is_gone(tmp_path):
    """AutoModel's layout, written by the real HuggingFaceStorageWriter (save_distributed: DCP shards)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    from stagerd.engine.adopt.detect import choose_preset
    from stagerd.engine.adopt.export import export_adopted
    from stagerd.engine.adopt.finished import finished

    ckpt = tmp_path / "epoch_0_step_2"
    (ckpt / "model" / ".hf_metadata").mkdir(parents=True)
    (ckpt / ".incomplete").touch()
    (ckpt / "model" / ".hf_metadata" / "config.json").write_text(
        '{"model_type": "llama", "dtype": "bfloat16"}'
    )
    sd = {"model.embed_tokens.weight": torch.randn(8, 4).bfloat16(), "lm_head.weight": torch.randn(8, 4)}
    dcp.save(
        sd, storage_writer=HuggingFaceStorageWriter(str(ckpt / "model"), save_distributed=True), no_dist=True
    )
    preset = choose_preset(ckpt, "auto")
    assert preset.name == "automodel" and finished(ckpt, preset) is None
    (ckpt / ".incomplete").unlink()
    assert finished(ckpt, preset) is not None
    r = export_adopted(ckpt, tmp_path / "work")
    got = load_file(r.export_dir / "model.safetensors")
    assert sorted(got) == sorted(sd) and all(torch.equal(got[k], sd[k]) for k in sd)
    # The config's own dtype, which the files hold (save_pretrained's: the first parameter's), not F32's.
    assert json.loads((r.export_dir / "config.json").read_text())["dtype"] == "bfloat16"


def test_a_checkpoint_already_in_hf_files_is_published_with_its_dtype(tmp_path):
    """torchtitan's `last_save_in_hf` writes through HuggingFaceStorageWriter with consolidation: HF files
    and their index, no `.metadata`. Written here by that same torch code."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    from stagerd.engine.adopt.export import export_adopted

    ckpt = tmp_path / "step-9"
    sd = {"model.embed_tokens.weight": torch.randn(8, 4), "model.norm.weight": torch.randn(4)}
    writer = HuggingFaceStorageWriter(str(ckpt), save_distributed=True, enable_consolidation=True)
    dcp.save(sd, storage_writer=writer, no_dist=True)
    r = export_adopted(ckpt, tmp_path / "work", dtype="bf16")
    got = {}
    for f in r.export_dir.glob("*.safetensors"):
        got.update(load_file(f))
    assert sorted(got) == sorted(sd) and all(torch.equal(got[k], sd[k].bfloat16()) for k in sd)


def test_a_peft_adapter_needs_its_config_and_is_cast_when_asked(tmp_path):
    """A Trainer's checkpoint of a PEFT model (the adapter alone, written by safetensors' `save_file` as
    PEFT does): without its adapter_config.json an AdoptError and nothing exported; with it, PEFT's names
    kept (never refused as a PEFT model's), no README.md but its own, and `--dtype bf16` casting the one
    `adapter_model.safetensors`."""
    import torch
    from safetensors.torch import load_file, save_file

    from stagerd.engine.adopt.export import export_adopted

    ckpt = tmp_path / "checkpoint-4"
    ckpt.mkdir()
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    sd = {name: torch.randn(2, 8), name.replace("lora_A", "lora_B"): torch.randn(8, 2)}
    save_file(sd, ckpt / "adapter_model.safetensors", metadata={"format": "pt"})
    (ckpt / "trainer_state.json").write_text("{}")
    with pytest.raises(AdoptError, match=r"without its adapter_config\.json"):
        export_adopted(ckpt, tmp_path / "work")
    assert not (tmp_path / "work" / "export").exists()
    (ckpt / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 2}')
    (tmp_path / "README.md").write_text("the user's own project")  # ROOT's: never the adapter's card
    r = export_adopted(ckpt, tmp_path / "work", dtype="bf16")
    assert [f for f, _ in r.files] == ["adapter_config.json", "adapter_model.safetensors"]
    got = load_file(r.export_dir / "adapter_model.safetensors")
    assert sorted(got) == sorted(sd) and all(torch.equal(got[k], sd[k].bfloat16()) for k in sd)
    assert (r.export_dir / "adapter_config.json").read_bytes() == (ckpt / "adapter_config.json").read_bytes()


def test_a_checkpoint_linked_away_while_it_is_read_is_not_what_is_exported(tmp_path, monkeypatch):
    """The checkpoint swapped for a link to another save of the same shapes (its .metadata the same) while
    its shards are read, and put back before the check that it did not change: the export held the other
    save's bytes. Now the export reads the directory it opened: the checkpoint's own bytes."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from stagerd.engine import export as export_mod
    from stagerd.engine.adopt.export import export_adopted

    ckpt, other, aside = tmp_path / "step-1", tmp_path / "other", tmp_path / "aside"
    sd = {"model": {"w": torch.arange(32.0).reshape(8, 4)}}
    dcp.save(sd, checkpoint_id=str(ckpt), no_dist=True)
    shutil.copytree(ckpt, other)
    for f in other.glob("*.distcp"):  # the tensor's bytes, in place in the record
        f.write_bytes(
            f.read_bytes().replace(sd["model"]["w"].numpy().tobytes(), (-sd["model"]["w"]).numpy().tobytes())
        )
    consolidate = export_mod.consolidate_into

    def swapped_while_read(*args: object, **kwargs: object) -> object:
        ckpt.rename(aside)
        ckpt.symlink_to(other, target_is_directory=True)
        try:
            return consolidate(*args, **kwargs)
        finally:
            ckpt.unlink()
            aside.rename(ckpt)

    monkeypatch.setattr(export_mod, "consolidate_into", swapped_while_read)
    r = export_adopted(ckpt, tmp_path / "work")
    assert torch.equal(load_file(r.export_dir / "model.safetensors")["w"], sd["model"]["w"])


@pytest.mark.parametrize("part", ["pytorch_model_fsdp_0", "pytorch_model_fsdp_0/__0_0.distcp"])
def test_a_subdirectory_or_data_file_linked_away_while_read_is_not_what_is_exported(
    tmp_path, monkeypatch, part
):
    """An HF Trainer checkpoint whose `pytorch_model_fsdp_0/` (or one data file in it) is swapped for a link
    to another save of the same shapes while it is read, and put back before the check that it held still:
    the export held the other save's tensor (every stat and `.metadata` matched again). Now the export
    reads the directory and files it opened: the checkpoint's own bytes."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from stagerd.engine import consolidate as consolidate_mod
    from stagerd.engine.adopt.export import export_adopted
    from stagerd.engine.adopt.source import AdoptOptions

    ckpt, other, aside = tmp_path / "checkpoint-1", tmp_path / "other", tmp_path / "aside"
    w = torch.arange(32.0).reshape(8, 4)
    dcp.save({"model": {"w": w}}, checkpoint_id=str(ckpt / "pytorch_model_fsdp_0"), no_dist=True)
    (ckpt / "trainer_state.json").write_text("{}")
    shutil.copytree(ckpt, other)
    for f in other.rglob("*.distcp"):  # the tensor's bytes, in place in the record
        f.write_bytes(f.read_bytes().replace(w.numpy().tobytes(), (-w).numpy().tobytes()))
    execute = consolidate_mod.execute  # the data files are read here; their headers before

    def swapped_while_read(*args: object, **kwargs: object) -> object:
        (ckpt / part).rename(aside)
        (ckpt / part).symlink_to(other / part, target_is_directory=(other / part).is_dir())
        try:
            return execute(*args, **kwargs)
        finally:
            (ckpt / part).unlink()
            aside.rename(ckpt / part)

    monkeypatch.setattr(consolidate_mod, "execute", swapped_while_read)
    r = export_adopted(ckpt, tmp_path / "work", AdoptOptions("hf-trainer"))
    assert torch.equal(load_file(r.export_dir / "model.safetensors")["w"], w)


def test_a_data_file_that_is_a_link_is_a_symlink_error(tmp_path):
    """A data file of the checkpoint that is a link to another save's (other bytes, the same shapes): its
    bytes were exported as this checkpoint's, every check passing. Now a SymlinkError naming it, one line."""
    import torch
    import torch.distributed.checkpoint as dcp

    from stagerd.engine.adopt.export import export_adopted
    from stagerd.engine.adopt.source import AdoptOptions
    from stagerd.errors import SymlinkError

    ckpt, other = tmp_path / "checkpoint-1", tmp_path / "other"
    dcp.save(
        {"model": {"w": torch.ones(8, 4)}}, checkpoint_id=str(ckpt / "pytorch_model_fsdp_0"), no_dist=True
    )
    (ckpt / "trainer_state.json").write_text("{}")
    shutil.copytree(ckpt, other)
    data = ckpt / "pytorch_model_fsdp_0" / "__0_0.distcp"
    data.unlink()
    data.symlink_to(other / data.relative_to(ckpt))
    with pytest.raises(SymlinkError) as e:
        export_adopted(ckpt, tmp_path / "work", AdoptOptions("hf-trainer"))
    assert e.value.path == str(data) and len(str(e.value).splitlines()) == 1 and "/proc/" not in str(e.value)
    assert not (tmp_path / "work" / "export").exists()


def test_a_subdirectory_left_a_link_after_it_was_read_is_a_source_changed_error(tmp_path, monkeypatch):
    """AutoModel's `model/` (HF shards, no `.metadata`) swapped for a link to a copy (the same names, sizes
    and mtimes) while it is read, and left there: read through the directory held, the export is the
    checkpoint's own, but its path now names another directory, which no stat by name tells (the copy's
    are the same). The held directory no longer at its name is a SourceChangedError (guard: the stats by
    name caught it while the reads were by name)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    from stagerd.engine import consolidate as consolidate_mod
    from stagerd.engine.adopt.export import export_adopted
    from stagerd.engine.adopt.source import AdoptOptions
    from stagerd.errors import SourceChangedError

    ckpt, other = tmp_path / "epoch_0_step_2", tmp_path / "other"
    model = ckpt / "model"
    writer = HuggingFaceStorageWriter(str(model), save_distributed=True)
    dcp.save({"model.w": torch.ones(8, 4)}, storage_writer=writer, no_dist=True)
    shutil.copytree(ckpt, other)  # copy2: the same mtimes
    execute = consolidate_mod.execute

    def swapped_for_good(*args: object, **kwargs: object) -> object:
        model.rename(tmp_path / "aside")
        model.symlink_to(other / model.name, target_is_directory=True)
        return execute(*args, **kwargs)

    monkeypatch.setattr(consolidate_mod, "execute", swapped_for_good)
    with pytest.raises(SourceChangedError) as e:
        export_adopted(ckpt, tmp_path / "work", AdoptOptions("automodel"))
    assert e.value.path.startswith(str(model)) and not (tmp_path / "work" / "export").exists()
