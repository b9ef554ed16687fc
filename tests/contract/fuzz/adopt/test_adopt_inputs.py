"""Fuzzing what stagerd reads when it adopts a trainer's checkpoint (`oracle.py` says the properties):
Lightning's meta.pt, DCP's `.metadata` and the `torch.save` records of torchtitan's (and AutoModel's
torch_save) checkpoints, AutoModel's HF shards opened whole (the header fuzz's mutants of them), and the
JSON beside them: config.json, AutoModel's adapter_config.json and
automodel_peft_config.json, the index of torchtitan's `last_save_in_hf`.

CI runs a fixed slice (`STAGERD_FUZZ_INPUTS` inputs per target, default 150, seed `STAGERD_FUZZ_SEED`,
default 0). A longer run is the same test with more:

    STAGERD_FUZZ_INPUTS=20000 STAGERD_FUZZ_SEED=$RANDOM python -m pytest -q -n 0 tests/contract/fuzz/adopt
"""

from __future__ import annotations

import io
import json
import os
import tracemalloc
import zipfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from stagerd.contract.adopt.dcp_metadata import read_metadata_bytes
from stagerd.contract.adopt.presets import PRESETS, Format
from stagerd.contract.reference_index import read_reference_index
from stagerd.engine.adopt.extras import read_config
from stagerd.engine.adopt.finished import finished
from stagerd.engine.parsed_extras import MAX_EXTRA_DEPTH
from stagerd.errors import ExtrasError
from tests.contract.fuzz.adopt import oracle
from tests.contract.fuzz.adopt.seeds import AdoptSeeds, make_seeds
from tests.contract.fuzz.oracle import Meter, Outcome

COUNT = int(os.environ.get("STAGERD_FUZZ_INPUTS", "150"))
SEED = int(os.environ.get("STAGERD_FUZZ_SEED", "0"))


@pytest.fixture(scope="module")
def seeds(tmp_path_factory) -> AdoptSeeds:
    return make_seeds(tmp_path_factory.mktemp("titan-save"))


def test_the_real_inputs_are_accepted(seeds, tmp_path):
    w = oracle.Work(tmp_path, Meter())
    assert oracle.meta_pt(seeds.meta_pt, w) == Outcome("finished", "")
    assert oracle.metadata(seeds.metadata, w) == Outcome("accepted", "")
    for r in seeds.records:
        assert oracle.record(r, w) == Outcome("accepted", "")
    name = sorted(seeds.shards)[0]
    assert oracle.automodel(seeds.shards[name], w, name, seeds.shards) == Outcome("accepted", "")
    for kind, obj in seeds.jsons.items():
        got = oracle.config(json.dumps(obj).encode(), w, kind)
        if kind == "composite":  # its head counts are its text_config's: the torchtitan preset wants them
            assert got.kind.startswith("ModelConfigError: preset torchtitan needs config.json's"), got
        elif kind in ("adapter_config", "automodel_peft_config"):  # scaled experts' rank, no top-k of 1
            assert got.stage == "use" and "at rank r // experts per token" in got.kind, got
        else:
            assert got == Outcome("accepted", ""), kind


@pytest.mark.parametrize("target", oracle.TARGETS)
def test_mutants_end_in_a_named_error_or_are_read_whole(seeds, tmp_path, target):
    out = oracle.sweep(target, seeds, tmp_path, COUNT, SEED, mem_every=10)
    stages = {o.stage for o in out}
    # the mutants reach past the first refusal: some are read whole, some refused
    assert stages & {"accepted", "finished"} and len(stages) >= 2, out


# ---------------------------------------------------------------------------------------------- found


def _nested(n: int) -> str:
    return '{"model_type": "qwen3", "rope_scaling": ' + "[" * n + "]" * n + "}"


def test_a_config_nested_past_the_limit_is_an_extras_error(tmp_path):
    """The decoder reads `[` ~950 deep; `json.dumps` of such a config, as the daemon keys its plans by
    config.json, raised RecursionError a few frames further down (transformers' config classes, which
    deep-copy it, far sooner). No config nests past a few levels."""
    p = tmp_path / "config.json"
    p.write_text(_nested(200))
    with pytest.raises(ExtrasError, match=r"config\.json nests its JSON over 64 levels deep"):
        read_config(p)
    p.write_text(_nested(MAX_EXTRA_DEPTH - 1))  # within the limit, with the object around it
    assert read_config(p) is not None


def test_a_config_the_reader_takes_survives_the_uses_below_it(tmp_path):
    """What the oracle checks of every config, at every depth up to the decoder's own limit: before, one
    the decoder took just short of its limit raised RecursionError out of the uses `DEEPER_USE` frames
    below the reader."""
    w = oracle.Work(tmp_path, Meter())
    for n in range(10, 1000, 7):
        assert oracle.config(_nested(n).encode(), w, "config").stage in ("read", "use")


def _traced(fn: Callable[[], object]) -> int:
    fn()
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


_READS: dict[str, Callable[[Path], object]] = {
    "config.json": lambda d: read_config(d / "config.json"),
    "index": lambda d: read_reference_index(d / "model.safetensors.index.json"),
    ".metadata": lambda d: read_metadata_bytes(d / ".metadata"),
    # the HF Trainer's completion rule (its index whole, then trainer_state.json), without its weights
    "finished": lambda d: finished(d, replace(PRESETS["hf-trainer"], model_dir=".", format=Format.HF_FILES)),
}


@pytest.mark.parametrize("read", list(_READS))
def test_a_small_file_is_read_into_memory_of_its_size(seeds, tmp_path, read):
    """Before: each read allocated its limit first (`read(limit)`): 16 MiB for any config.json, 64 MiB for
    an index, 256 MiB for a `.metadata`, on every scan of every checkpoint."""
    (tmp_path / "config.json").write_text(json.dumps(seeds.jsons["config"]))
    # whole JSON that hf_files refuses: `finished` reads it again to tell, then trainer_state.json
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"w": "../w.safetensors"}}')
    (tmp_path / ".metadata").write_bytes(seeds.metadata)
    (tmp_path / "trainer_state.json").write_text('{"global_step": 5}')
    assert _READS[read](tmp_path) is not None
    assert _traced(lambda: _READS[read](tmp_path)) < 1 << 20


def test_a_meta_pt_naming_a_zip_version_past_zipfiles_is_not_finished(seeds, tmp_path):
    """Before: zipfile's NotImplementedError ("zip file version 12.8") out of `finished`, which the daemon
    asks of every checkpoint on every scan."""
    blob = bytearray(seeds.meta_pt)
    at = blob.find(b"PK\x01\x02")
    blob[at + 6 : at + 8] = (128).to_bytes(2, "little")  # the version needed to extract: 12.8
    w = oracle.Work(tmp_path, Meter())
    assert oracle.meta_pt(bytes(blob), w) == Outcome("not finished", "")
    assert oracle.meta_pt(seeds.meta_pt, w) == Outcome("finished", "")


def _record_with(seed: bytes, compress: int = zipfile.ZIP_STORED, pkl: bytes | None = None) -> bytes:
    """The seed record's archive written again, its data.pkl compressed or replaced."""
    with zipfile.ZipFile(io.BytesIO(seed)) as z:
        members = [(i.filename, z.read(i)) for i in z.infolist()]
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name, data in members:
            is_pkl = name.endswith("/data.pkl")
            z.writestr(name, pkl if is_pkl and pkl is not None else data, compress if is_pkl else 0)
    return out.getvalue()


def _record_peak(blob: bytes, tmp_path: Path) -> tuple[Outcome, int]:
    w = oracle.Work(tmp_path, Meter())
    tracemalloc.start()
    try:
        return oracle.record(blob, w), w.meter.peak
    finally:
        tracemalloc.stop()


def test_a_record_whose_directory_claims_a_huge_data_pkl_is_refused_unread(seeds, tmp_path):
    """Before: its size was checked as uncompressed (154 bytes) and zipfile read it in one `read` of the
    stored size the directory claims: 940 MB allocated for a 2 KB record."""
    blob = bytearray(seeds.records[2])
    at = blob.find(b"PK\x01\x02")  # data.pkl's directory entry comes first
    assert blob[at + 46 : at + 46 + 16].endswith(b"/data.pkl")
    blob[at + 20 : at + 24] = (987_454_493).to_bytes(4, "little")  # its compressed (stored) size
    outcome, peak = _record_peak(bytes(blob), tmp_path)
    assert outcome == Outcome("record", "DcpFormatError: the record at offset _ has a _-byte data.pkl")
    assert peak < 1 << 20


def test_a_compressed_data_pkl_is_refused_uninflated(seeds, tmp_path):
    """torch.save stores its records' members. A deflated data.pkl whose directory says 153 bytes was
    inflated whole (up to 2 GiB at once) before zipfile cut it to that size: here 64 MiB from 64 KB."""
    pkl = zipfile.ZipFile(io.BytesIO(seeds.records[0])).read("archive/data.pkl")
    blob = bytearray(_record_with(seeds.records[0], zipfile.ZIP_DEFLATED, pkl + bytes(64 << 20)))
    at = blob.find(b"PK\x01\x02")  # data.pkl's directory entry: its uncompressed size now the pickle's
    blob[at + 24 : at + 28] = len(pkl).to_bytes(4, "little")
    assert len(blob) < 1 << 20
    outcome, peak = _record_peak(bytes(blob), tmp_path)
    assert outcome.stage == "record" and "compressed data.pkl" in outcome.kind, outcome
    assert peak < 1 << 20


def test_a_config_value_is_quoted_in_a_message_bounded(seeds, tmp_path):
    """Before: a 900 KB num_attention_heads string was quoted whole in the one-line error (and in the
    daemon's status), as was adapter_config.json's r and an index's file name."""
    long = "\x1b[2J" * 100_000
    w = oracle.Work(tmp_path, Meter())
    for kind, cfg in (
        ("config", {**seeds.jsons["config"], "num_attention_heads": long}),
        ("config", {**seeds.jsons["config"], "num_key_value_heads": 10**4200}),
        ("adapter_config", {**seeds.jsons["adapter_config"], "rank_pattern": {}, "r": long}),
        ("index", {"weight_map": {"w": "../" + long}}),
    ):
        assert oracle.config(json.dumps(cfg).encode(), w, kind).stage in ("read", "use"), kind
