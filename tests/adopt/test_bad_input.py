"""Bad checkpoints under an adopted ROOT: each is a named error and one line in `status`, nothing of it is
published, and the good checkpoints beside it go on. Also a daemon killed in the middle of an adopted
export resumes it and publishes the step exactly once."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import struct
import zipfile
from pathlib import Path

import pytest

from stagerd.contract.adopt.dcp_metadata import parse_dcp_metadata
from stagerd.engine.adopt.torch_record import read_record
from stagerd.errors import DcpFormatError
from tests.adopt import ranks
from tests.adopt.helpers import published, tree_digest, watch_once
from tests.cli_helpers import run_cli
from tests.fidelity import models

EVIL = b"cos\nsystem\n(S'touch /tmp/stagerd-pwned'\ntR."
# A dict keyed by a tuple nested a million deep: 1 MB of opcodes no allowlist sees (no global), and
# CPython 3.11 hashes the key by recursing in C without a depth check (SIGSEGV at ~150k levels).
DEEP = b"\x80\x04}" + b")" + b"\x85" * 1_000_000 + b"K\x01s."


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


def _peft(path: Path) -> None:
    """What a PEFT LoRA model's own loop (or the HF Trainer's FSDP save of one) writes: its state dict under
    `model.`, PEFT's names (`...q_proj.base_layer.weight`, `...lora_A.default.weight`). Published as they
    are, from_pretrained of the base model would find none of its weights and load it at random."""
    import torch.distributed.checkpoint as dcp
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        tf.LlamaForCausalLM(models.config("llama")), LoraConfig(r=2, target_modules=["q_proj"])
    )
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(path), no_dist=True)


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
    shutil.copytree(root / "step-1", root / "step-9")
    (root / "step-9" / ".metadata").write_bytes(DEEP)
    # Never finished, so never touched; before, the FIFOs held the scan (and `--once`) for good, and the
    # deep trainer_state.json raised RecursionError out of it.
    shutil.copytree(root / "step-1", root / "step-10")
    (root / "step-10" / ".metadata").unlink()
    os.mkfifo(root / "step-10" / ".metadata")
    for n in (11, 12):
        shutil.copytree(root / "step-1", root / f"checkpoint-{n}" / "pytorch_model_fsdp_0")
    os.mkfifo(root / "checkpoint-11" / "trainer_state.json")
    (root / "checkpoint-12" / "trainer_state.json").write_text("[" * 100_000)
    _peft(root / "step-5")
    _titan(root / "step-7", extra=False)
    _titan(root / "step-8", extra=True)
    _titan(root / "step-13", extra=False)
    wrong = {"model_type": "llama", "num_attention_heads": 2}  # its own: the rest a default 7B's sizes
    (root / "step-13" / "config.json").write_text(json.dumps(wrong))
    cfg = {
        "model_type": "llama",
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "hidden_size": 8,
        "vocab_size": 16,
        "intermediate_size": 12,
        "num_hidden_layers": 1,
    }  # the other titan steps' model, every size of it
    (root / "config.json").write_text(json.dumps(cfg))
    return root


def test_each_bad_checkpoint_is_a_named_error_and_the_good_ones_are_published(root, tmp_path):
    before = tree_digest(root)
    res = watch_once(root, tmp_path / "out")
    assert res.returncode != 0
    assert "2 step(s) published, 8 not" in res.stdout, res.stdout + res.stderr
    assert published(tmp_path / "out", 1).is_dir() and published(tmp_path / "out", 7).is_dir()
    assert not Path("/tmp/stagerd-pwned").exists()
    status = run_cli(["status", root]).stdout
    rows = [ln.split() for ln in status.splitlines() if ln.strip()[:1].isdigit()]
    lines = {int(r[0]): " ".join(r) for r in rows if r[1] in ("published", "quarantined")}
    want = {2: "DcpFormatError", 3: "DcpFormatError", 4: "ShardError", 6: "AdoptError", 8: "HubPlanError"}
    want[5] = "AdoptError"  # a PEFT model's names: before, published, and loaded as a random model
    want[9] = "DcpFormatError"  # the daemon lives on: before, its process died of SIGSEGV
    want[13] = "ModelShapeError"  # before, published: from_pretrained built the config's 7B and died
    for step, error in want.items():
        assert "quarantined" in lines[step] and error in lines[step], (step, lines[step])
        assert not published(tmp_path / "out", step).exists()
    for step in (10, 11, 12):
        assert step not in lines and not published(tmp_path / "out", step).exists()
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


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    """A FileSystemWriter checkpoint of one tensor, its record longer than DEEP: (its dir, its file)."""
    import torch
    import torch.distributed.checkpoint as dcp

    src = tmp_path_factory.mktemp("record") / "ck"
    dcp.save({"w": torch.zeros(257_500)}, checkpoint_id=str(src), no_dist=True)
    return src, next(src.glob("*.distcp"))


def _with_pkl(data: bytes, pkl: bytes) -> bytes:
    """A record of `data`'s length holding a data.pkl of `pkl` (and a filler member) but no storage."""
    name = next(n for n in zipfile.ZipFile(io.BytesIO(data)).namelist() if n.endswith("/data.pkl"))

    def build(fill: int) -> bytes:
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as nz:
            nz.writestr(name, pkl)
            nz.writestr(name.replace("data.pkl", "filler"), b"\0" * fill)
        return out.getvalue()

    return build(len(data) - len(build(0)))


def _pkl_entry(b: bytearray) -> int:
    """Where data.pkl's central directory entry starts."""
    at = b.index(b"PK\x01\x02")
    while not bytes(b[at + 46 : at + 46 + struct.unpack_from("<H", b, at + 28)[0]]).endswith(b"data.pkl"):
        at = b.index(b"PK\x01\x02", at + 4)
    return at


def _method(m: int):
    return lambda b: struct.pack_into("<H", b, _pkl_entry(b) + 10, m)


def test_a_damaged_tensor_record_is_a_named_error_never_a_traceback(record, tmp_path):
    """Before: NotImplementedError, RuntimeError, zlib.error and AttributeError came out raw (exit 1)."""
    _, path = record
    damages = {
        "an unsupported compression method": _method(1),
        "an encrypted data.pkl": lambda b: struct.pack_into("<H", b, _pkl_entry(b) + 8, 1),
        "deflate data that is not": _method(8),
        "a BUILD on an int": lambda b: b.__setitem__(slice(None), _with_pkl(bytes(b), b"\x80\x02K\x01}b.")),
    }
    for what, damage in damages.items():
        b = bytearray(path.read_bytes())
        damage(b)
        bad = tmp_path / "bad.distcp"
        bad.write_bytes(bytes(b))
        fd = os.open(bad, os.O_RDONLY)
        try:
            with pytest.raises(DcpFormatError, match="damaged") as e:
                read_record(fd, 0, len(b), bad)
        finally:
            os.close(fd)
        assert str(bad) in str(e.value) and "\n" not in e.value.message, what


def _edited_metadata(src: Path, tmp_path: Path, edit) -> Path:
    """`src`'s .metadata, unpickled with torch, changed by `edit` and written beside the test."""
    with open(src / ".metadata", "rb") as f:
        meta = pickle.load(f)
    edit(meta)
    out = tmp_path / ".metadata"
    out.write_bytes(pickle.dumps(meta))
    return out


def _renamed(fqn: str):
    def edit(meta) -> None:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        meta.state_dict_metadata[fqn] = meta.state_dict_metadata.pop("w")
        meta.storage_data = {MetadataIndex(fqn, k.offset, k.index): v for k, v in meta.storage_data.items()}

    return edit


def _offsets_of(value: object):
    def edit(meta) -> None:
        for k in meta.storage_data:
            object.__setattr__(k, "offset", value)

    return edit


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        (_renamed("model.\udc80"), "is not valid UTF-8"),
        (_offsets_of("abc"), "torch.Size of"),
    ],
    ids=["a-lone-surrogate", "an-offset-not-a-size"],
)
def test_a_bad_name_or_offset_in_dcp_metadata_is_a_named_error_with_its_path(record, tmp_path, edit, said):
    """pickle decodes a name with surrogatepass: a lone surrogate passed the reader, then was a bare
    UnicodeEncodeError in the export. A storage offset that is no torch.Size was an error with no path."""
    from stagerd.contract.adopt.dcp_metadata import read_dcp_metadata

    path = _edited_metadata(record[0], tmp_path, edit)
    with pytest.raises(DcpFormatError, match=said) as e:
        read_dcp_metadata(path)
    assert e.value.path == str(path)


def _zip64_directory_at(shift: int):
    """The zip64 end record's offset of the central directory moved by `shift` bytes."""

    def damage(b: bytearray) -> None:
        at = b.rindex(b"PK\x06\x06") + 48
        struct.pack_into("<Q", b, at, struct.unpack_from("<Q", b, at)[0] + shift)

    return damage


def test_a_member_placed_before_its_record_is_a_named_error(record, tmp_path):
    """zipfile shifts every member by the directory's stated place against its found one: a corrupted zip64
    offset put the storage 2 TiB before the record, and its pread was a bare OSError (EINVAL)."""
    _, path = record
    b = bytearray(path.read_bytes())
    _zip64_directory_at(2 << 40)(b)
    bad = tmp_path / "bad.distcp"
    bad.write_bytes(bytes(b))
    fd = os.open(bad, os.O_RDONLY)
    try:
        with pytest.raises(DcpFormatError) as e:
            read_record(fd, 0, len(b), bad)
    finally:
        os.close(fd)
    assert e.value.path == str(bad) and "lies outside the record" in e.value.message


def test_a_deeply_nested_pickle_is_refused_before_it_is_loaded(record, tmp_path):
    """In `.metadata` and in a record's data.pkl: before, `consolidate --adopt` died of SIGSEGV."""
    src, path = record
    for where in (".metadata", "data.pkl"):
        ck = tmp_path / where.strip(".") / "step-1"
        shutil.copytree(src, ck)
        if where == ".metadata":
            (ck / where).write_bytes(DEEP)
        else:
            (ck / path.name).write_bytes(_with_pkl(path.read_bytes(), DEEP))
        res = run_cli(["consolidate", ck, tmp_path / where.strip(".") / "out", "--adopt", "dcp"])
        assert res.returncode == 2, (where, res.returncode, res.stderr[-400:])
        assert "DcpFormatError" in res.stderr and "more than 100 deep" in res.stderr, res.stderr
        assert not (tmp_path / where.strip(".") / "out").exists()
    with pytest.raises(DcpFormatError, match="more than 100 deep"):
        parse_dcp_metadata(DEEP, "x")


def _path_of(*body: bytes) -> bytes:
    """A pickle calling pathlib.PosixPath (allowed: DCP pickles checkpoint paths) on what `body` pushes."""
    return b"\x80\x04cpathlib\nPosixPath\n(" + b"".join(body) + b"tR."


def test_a_pickled_path_cannot_make_memory_grow_past_its_bytes():
    """Before: str() of each part (a list holding the one below twice, 22 deep: 2^22 copies) and one
    memoized 64 KB string 1,000 times over were built in full, 25 MB and 64 MB from 1 kB and 66 kB."""
    import tracemalloc

    doubled = b"]\x94" + b"".join(b"](h%ch%ce\x94" % (i, i) for i in range(22))
    repeated = b"X\x00\x00\x01\x00" + b"a" * 65536 + b"\x94" + b"h\x00" * 1000
    for data in (_path_of(doubled, b"h\x16"), _path_of(repeated)):
        tracemalloc.start()
        try:
            with pytest.raises(DcpFormatError, match="path"):
                parse_dcp_metadata(data, "x")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 8 * len(data) + (1 << 20), peak


def test_a_chunk_memoized_many_times_is_refused_not_multiplied():
    """Before: one chunk record referenced again through the pickle memo (two bytes a reference) became a
    new chunk per reference: 200k chunks from 400 kB, 12 GB at the size limit."""
    import tracemalloc

    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    chunk = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([4]))
    md = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4]), [chunk] * 200_000)
    storage = {MetadataIndex("w", torch.Size([0])): _StorageInfo("__0_0.distcp", 0, 16)}
    data = pickle.dumps(Metadata({"w": md}, storage_data=storage))
    assert len(data) < 600_000
    tracemalloc.start()
    try:
        with pytest.raises(DcpFormatError, match=r"'w'.*chunk at \[0\] recorded twice"):
            parse_dcp_metadata(data, "x")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * len(data) + (1 << 20), peak
    one = pickle.dumps(
        Metadata({"w": TensorStorageMetadata(md.properties, md.size, [chunk])}, storage_data=storage)
    )
    assert parse_dcp_metadata(one, "x").tensors["w"].chunks[0].sizes == (4,)


class _Touch:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_the_trainers_own_pickles_beside_an_adopted_checkpoint_are_never_loaded(tmp_path):
    """The HF Trainer's optimizer, scheduler, scaler, RNG and arguments are pickles: each here runs code
    when unpickled, and the step is published without any of them being loaded or sent."""
    import torch
    from safetensors.torch import save_file

    ck = tmp_path / "run" / "checkpoint-5"
    ck.mkdir(parents=True)
    w = {"model.embed_tokens.weight": torch.randn(4, 2), "lm_head.weight": torch.randn(4, 2)}
    save_file(w, ck / "model.safetensors", metadata={"format": "pt"})
    cfg = {"model_type": "llama", "vocab_size": 4, "hidden_size": 2, "num_attention_heads": 1}  # w's model
    (ck / "config.json").write_text(json.dumps(cfg))
    pickles = ("optimizer.pt", "scheduler.pt", "scaler.pt", "rng_state.pth", "rng_state_0.pth")
    for n in (*pickles, "training_args.bin"):
        torch.save({"x": _Touch(tmp_path / f"pwned-by-{n}")}, ck / n)
    (ck / "trainer_state.json").write_text(json.dumps({"global_step": 5, "log_history": []}))
    res = watch_once(tmp_path / "run", tmp_path / "out")
    assert res.returncode == 0 and "1 step(s) published, 0 not" in res.stdout, res.stdout + res.stderr
    assert sorted(p.name for p in published(tmp_path / "out", 5).iterdir()) == [
        "config.json",
        "model.safetensors",
        "stagerd.manifest.json",
    ]
    assert not list(tmp_path.glob("pwned-by-*"))


def test_a_chunk_file_name_holding_a_nul_is_refused_by_name(record, tmp_path):
    """Before: `consolidate --adopt` died of a raw ValueError (embedded null byte) opening it."""
    import dataclasses

    src, _ = record
    ck = tmp_path / "step-1"
    shutil.copytree(src, ck)
    meta = pickle.loads((src / ".metadata").read_bytes())  # the test's own save: trusted
    for k, v in meta.storage_data.items():
        meta.storage_data[k] = dataclasses.replace(v, relative_path=v.relative_path.replace("_", "\0", 1))
    (ck / ".metadata").write_bytes(pickle.dumps(meta))
    res = run_cli(["consolidate", ck, tmp_path / "out", "--adopt", "dcp"])
    assert res.returncode == 2 and "DcpFormatError" in res.stderr and "not a plain name" in res.stderr, (
        res.stderr
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("config", "said"),
    [
        (None, "ModelConfigError: preset torchtitan needs the model's config.json"),
        (b'{"model_type": "llama",', "config.json: config.json is not valid JSON"),
    ],
)
def test_a_torchtitan_checkpoint_without_a_good_config_is_named_so_with_what_to_do(tmp_path, config, said):
    """Before: "config.json gives None" where there was none, the daemon's "15 is not valid JSON" (the
    descriptor it read the file by), and the `--once` summary's hints (the classes') told the user to fix
    a mapping or save without model=, or to save the step again, none of which an adopting user does."""
    _titan(tmp_path / "root" / "step-1", extra=False)
    if config is not None:
        (tmp_path / "root" / "config.json").write_bytes(config)
    res = watch_once(tmp_path / "root", tmp_path / "out")
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "0 step(s) published, 1 not" in out, out
    line = next(ln for ln in res.stdout.splitlines() if ln.strip().startswith("step 1:"))
    assert said in line and "--extras DIR holding" in line, line
    assert "model=" not in line and "save the step again" not in line, line
    assert not published(tmp_path / "out", 1).exists()
