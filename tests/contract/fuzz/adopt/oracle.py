"""The fuzz oracle for what an adopted checkpoint's reader takes in: each input goes through the real
readers under the header fuzz's time limit (a SIGALRM `Hang`) and allocation meter, then through what uses
what they accepted.

Properties, for every input:
- the only exceptions are stagerd's named errors (StagerdError), each one line; a completion file that
  cannot be read yet is `finished()`'s None, never an exception (the daemon asks it on every scan);
- nothing in a pickle runs but the allowlisted records (`Canary` is never called);
- what a reader accepts holds up: a `.metadata`'s chunks lie in their tensors, a record's bytes in its
  record, a config.json is a JSON object every later reader of it (exported_config, the presets' mapping,
  the PEFT checks, a `json.dumps` of it as the daemon keys its plans) takes without an unnamed error.
"""

from __future__ import annotations

import functools
import json
import math
import os
import random
import tracemalloc
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stagerd.contract import dtypes
from stagerd.errors import StagerdError
from tests.contract.fuzz import inputs as header_inputs
from tests.contract.fuzz.adopt import inputs, json_inputs
from tests.contract.fuzz.adopt.inputs import Canary
from tests.contract.fuzz.adopt.seeds import TITAN_SHAPES, AdoptSeeds
from tests.contract.fuzz.oracle import Meter, Outcome, Seed, error_kind, time_limit

# How much deeper than its reader the daemon's later uses of a config may run (its threads' stacks, the
# planners' own frames): a JSON tree the reader took must survive a recursive walk from there.
DEEPER_USE = 120
# A read may trace this much plus MEM_PER_BYTE per input byte (the header fuzz's bound): a claimed count,
# size or offset turned into an allocation blows far past it.
MAX_MESSAGE_CHARS = 4096
MEM_BASE = 64 * 1024
MEM_PER_BYTE = 32
MEM_TRACED_BYTES = 256 << 10  # larger inputs (a JSON string of MBs) only slow the tracer: claims are small


def named(e: StagerdError, stage: str) -> Outcome:
    text = str(e)
    assert len(text.splitlines()) <= 1, text[:300]
    return Outcome(stage, error_kind(e))


def _deeper(n: int, fn: Callable[[], Any]) -> Any:
    """`fn()` called `n` frames below this one."""
    return fn() if n <= 0 else _deeper(n - 1, fn)


@dataclass
class Work:
    """A scratch directory the checks write their inputs into (one file per input, overwritten)."""

    dir: Path
    meter: Meter


def meta_pt(blob: bytes, w: Work) -> Outcome:
    """Lightning's completion rule: `finished()` reads meta.pt's zip directory; never an exception."""
    from stagerd.contract.adopt.presets import PRESETS
    from stagerd.engine.adopt.finished import finished

    ckpt = w.dir / "epoch=0-step=5.ckpt"
    ckpt.mkdir(exist_ok=True)
    (ckpt / ".metadata").touch()
    (ckpt / "meta.pt").write_bytes(blob)
    with time_limit(), w.meter.lib():
        when = finished(ckpt, PRESETS["lightning"])
    return Outcome("finished" if when is not None else "not finished", "")


def metadata(blob: bytes, w: Work) -> Outcome:
    """`.metadata` through the allowlist reader, then torchtitan's preset over what it holds."""
    from stagerd.contract.adopt.dcp_metadata import parse_dcp_metadata
    from stagerd.contract.adopt.presets import PRESETS, resolve_selection
    from tests.contract.fuzz.adopt.seeds import CONFIG

    try:
        with time_limit(), w.meter.lib():
            meta = parse_dcp_metadata(blob, "ckpt/.metadata")
    except StagerdError as e:
        return named(e, "metadata")
    finally:
        assert not Canary.touched, "an unpickled value ran code"
    for t in meta.tensors.values():
        dtypes.lookup(t.dtype)
        assert all(isinstance(d, int) and d >= 0 for d in t.shape)
        for c in t.chunks:
            assert len(c.offsets) == len(c.sizes) == len(t.shape)
            assert all(o + s <= d for o, s, d in zip(c.offsets, c.sizes, t.shape, strict=True))
            assert c.file and "/" not in c.file and "\0" not in c.file and c.offset >= 0 and c.length >= 0
    assert set(meta.files) == {c.file for t in meta.tensors.values() for c in t.chunks}
    try:
        with time_limit(), w.meter.lib():
            shapes = {k: t.shape for k, t in meta.tensors.items()}
            resolve_selection(PRESETS["torchtitan"], shapes, config=CONFIG)
    except StagerdError as e:
        return named(e, "plan")
    return Outcome("accepted", "")


def record(blob: bytes, w: Work) -> Outcome:
    """A `torch.save` record inside a `.distcp` file (bytes before and after it), read in place."""
    from stagerd.engine.adopt.torch_record import read_record
    from stagerd.errors import DcpFormatError

    base, path = 37, w.dir / "__0_0.distcp"
    path.write_bytes(b"\xab" * base + blob + b"PK\x03\x04" * 8)
    fd = os.open(path, os.O_RDONLY)
    try:
        with time_limit(), w.meter.lib():
            t = read_record(fd, base, len(blob), path)
    except DcpFormatError as e:
        return named(e, "record")
    finally:
        os.close(fd)
        assert not Canary.touched, "an unpickled value ran code"
    assert base <= t.begin and t.begin + t.nbytes <= base + len(blob), t
    assert t.nbytes == dtypes.lookup(t.dtype).nbytes(math.prod(t.shape)), t
    return Outcome("accepted", "")


def automodel(blob: bytes, w: Work, name: str, shards: dict[str, bytes]) -> Outcome:
    """AutoModel's checkpoint (`epoch_E_step_S/model/`, its `.hf_metadata/config.json`) with the shard
    `name` replaced by `blob`, opened as the daemon opens it, and its headers scanned for the export."""
    from stagerd.engine.adopt.source import AdoptOptions, open_adopted
    from tests.contract.fuzz.adopt.seeds import CONFIG

    ckpt = w.dir / "epoch_0_step_5"
    model = ckpt / "model"
    (model / ".hf_metadata").mkdir(parents=True, exist_ok=True)
    (model / ".hf_metadata" / "config.json").write_text(json.dumps(CONFIG))
    for n, data in shards.items():
        (model / n).write_bytes(blob if n == name else data)
    try:
        with time_limit(), w.meter.lib():
            src = open_adopted(ckpt, AdoptOptions("automodel"))
            headers = list(src.scan())
    except StagerdError as e:
        return named(e, "open")
    assert src.preset.name == "automodel" and {h.path for h in headers} == {str(model / n) for n in shards}
    assert set(src.keys) <= {k for h in headers for k in h.tensors}
    return Outcome("accepted", "")


def config(blob: bytes, w: Work, kind: str) -> Outcome:
    """config.json (and its kin, by `kind`, a seed's name) read as the adopted source reads it, then handed
    to what reads it after: the presets, the PEFT checks, the exported config.json, the daemon's key."""
    from stagerd.engine.adopt.extras import read_config

    path = w.dir / "config.json"
    path.write_bytes(blob)
    try:
        with time_limit(), w.meter.lib():
            cfg = read_config(path)
    except StagerdError as e:
        assert len(str(e)) < MAX_MESSAGE_CHARS, str(e)[:300]
        return named(e, "read")
    assert isinstance(cfg, dict)
    try:
        with time_limit(), w.meter.lib():
            _deeper(DEEPER_USE, lambda: _uses(cfg, path, kind))
    except StagerdError as e:
        # config.json's values are the trainer's, and quoted in messages: bounded, never the file again
        assert len(str(e)) < MAX_MESSAGE_CHARS, str(e)[:300]
        return named(e, "use")
    return Outcome("accepted", "")


def _uses(cfg: dict[str, Any], path: Path, kind: str) -> None:
    from stagerd.contract.adopt.peft_names import experts_per_token, refuse_scaled_expert_rank
    from stagerd.contract.adopt.presets import PRESETS, preset_mapping, resolve_selection
    from stagerd.engine.hub_config import exported_config
    from tests.contract.fuzz.adopt.seeds import ADAPTER_CONFIG, AUTOMODEL_PEFT_CONFIG

    json.dumps(cfg, sort_keys=True, default=str)  # the daemon's plan cache key (daemon/hf_names.py)
    if kind in ("config", "composite"):
        experts_per_token(cfg)
        titan = PRESETS["torchtitan"]
        preset_mapping(titan, cfg)
        resolve_selection(titan, TITAN_SHAPES, config=cfg)
        for cast in (None, "BF16"):
            out = exported_config(path, {"F32": 4096, "BF16": 64}, cast)
            assert out is not None and isinstance(json.loads(out), dict)
    elif kind in ("adapter_config", "automodel_peft_config"):
        names = ["model.layers.0.mlp.experts.lora_A.weight"]
        pair = (cfg, ADAPTER_CONFIG) if kind == "automodel_peft_config" else (AUTOMODEL_PEFT_CONFIG, cfg)
        refuse_scaled_expert_rank(*pair, names, lambda: cfg)  # cfg as the base config.json too
    elif kind == "index":
        from stagerd.engine.adopt.finished import finished, hf_files

        d = path.parent / "hf"
        d.mkdir(exist_ok=True)
        (d / "model.safetensors.index.json").write_bytes(path.read_bytes())
        finished(d, PRESETS["hf"])
        files = hf_files(d)
        assert all(f.parent == d for f in files), files


# ---------------------------------------------------------------------------------------------- runs


class Failed(AssertionError):
    """An input that broke a property: which one, to run again (`inputs_of(target, seeds, seed)`)."""


def inputs_of(target: str, s: AdoptSeeds, seed: int) -> Iterator[tuple[bytes, Callable[[Work], Outcome]]]:
    """The endless, deterministic inputs of one target from the seeds: (input, its check)."""
    r = random.Random(f"{target}:{seed}")
    while True:
        if target == "meta.pt":
            blob = inputs.zip_damage(r, s.meta_pt)
            yield blob, functools.partial(meta_pt, blob)
        elif target == ".metadata":
            blob = inputs.metadata_mutant(r, s.metadata)
            yield blob, functools.partial(metadata, blob)
        elif target == "automodel":
            name = r.choice(sorted(s.shards))
            seed_ = Seed.from_bytes(s.shards[name], name)
            blob = header_inputs.mutate(seed_, r) if r.random() < 0.8 else inputs.damage(r, s.shards[name])
            yield blob, functools.partial(automodel, blob, name=name, shards=s.shards)
        elif target == "record":
            blob = inputs.record_mutant(r, r.choice(s.records))
            yield blob, functools.partial(record, blob)
        else:
            kind = r.choice(sorted(s.jsons))
            blob = json_inputs.json_mutant(r, s.jsons[kind])
            yield blob, functools.partial(config, blob, kind=kind)


TARGETS = ("meta.pt", ".metadata", "record", "automodel", "json")


def sweep(target: str, s: AdoptSeeds, tmp: Path, count: int, seed: int, mem_every: int = 0) -> Counter:
    """Run `count` inputs of `target`; each `mem_every`th (of at most MEM_TRACED_BYTES) also under
    tracemalloc, its peak bounded by its own size. Returns how many ended at each outcome; the first
    broken property raises `Failed`."""
    out: Counter = Counter()
    gen = inputs_of(target, s, seed)
    for i in range(count):
        blob, check = next(gen)
        w = Work(tmp, Meter())
        traced = mem_every > 0 and i % mem_every == 0 and len(blob) <= MEM_TRACED_BYTES
        if traced:
            check(w)  # once untraced: lazy imports and caches are not the input's
            tracemalloc.start()
        try:
            out[check(w)] += 1
        except Exception as e:
            at = f"{target} input {i} of seed {seed} ({len(blob)} bytes)"
            raise Failed(f"{at}: {type(e).__name__}: {e}") from e
        finally:
            if traced:
                tracemalloc.stop()
        if traced:
            bound = MEM_BASE + MEM_PER_BYTE * len(blob)
            if w.meter.peak >= bound:
                raise Failed(f"{target} input {i} of seed {seed}: {w.meter.peak} bytes traced, over {bound}")
    return out
