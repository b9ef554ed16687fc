"""The fuzz oracle for the header parser: parse an input under a time limit and an allocation meter, and
check what was accepted. `test_fuzz_headers` and `bench/fuzz_headers.py` both run it."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
import signal
import struct
import tracemalloc
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stagerd.contract import dtypes
from stagerd.contract.header_entries import MAX_NDIM
from stagerd.contract.safetensors_format import (
    Header,
    encode_header,
    parse_dcp_sharding_info,
    parse_header_bytes,
    read_header,
    validate_header,
)
from stagerd.errors import DTypeError, HeaderError, ShardError, StagerdError

ALLOWED = (HeaderError, DTypeError, ShardError)
PER_INPUT_SECONDS = 2.0
SHARDING = "DCP_SHARDING_INFO"


class Hang(Exception):
    """An input that ran past the per-input time bound."""


@contextmanager
def time_limit(seconds: float = PER_INPUT_SECONDS) -> Iterator[None]:
    """Raise `Hang` in the running code if it is still running after `seconds` (main thread only)."""

    def on_alarm(signum: int, frame: object) -> None:
        raise Hang(f"input still running after {seconds}s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# ---------------------------------------------------------------------------------------------- oracle


@dataclass(frozen=True)
class Outcome:
    """How far an input got: `stage` (bytes, entries, sharding, plan, accepted) and a normalized message."""

    stage: str
    kind: str


# Single character-class repeats only: a repeated group would make `re` allocate per character.
_NOISE = re.compile(r"'[^']*'|\"[^\"]*\"|\[[^\]]*\]|\{[^}]*\}|\d+")


def error_kind(e: StagerdError) -> str:
    """The message template of an error: names, numbers and lists blanked, so kinds can be counted."""
    return f"{e.name}: {_NOISE.sub('_', e.message[:2000])[:120]}"  # the sub is slow on MBs


def check_accepted(h: Header, n: int, size: int) -> None:
    """What the parser accepted must agree with the file: anything else is a parser bug."""
    assert h.data_start == 8 + n <= size
    data_len = size - h.data_start
    live = []
    for t in h.tensors.values():
        assert len(t.shape) <= MAX_NDIM
        assert 0 <= t.begin <= t.end <= data_len, t
        assert t.end - t.begin == dtypes.lookup(t.dtype).nbytes(math.prod(t.shape)), t
        if t.end > t.begin:
            live.append(t)
    live.sort(key=lambda t: t.begin)
    for a, b in itertools.pairwise(live):
        assert a.end <= b.begin, (a, b)
    # Accepted means it can be written back: the export writes these names into its own headers.
    entries = {t.name: (t.dtype, t.shape, t.begin, t.end) for t in h.tensors.values()}
    again = encode_header(entries, h.metadata)
    n2, obj2 = parse_header_bytes("re-encoded", again, len(again) + data_len)
    h2 = validate_header("re-encoded", n2, obj2, len(again) + data_len)
    assert {k: (t.dtype, t.shape, t.nbytes) for k, t in h2.tensors.items()} == {
        k: (t.dtype, t.shape, t.nbytes) for k, t in h.tensors.items()
    }


class Meter:
    """Peak traced allocation of the library calls alone, the oracle's own checks excluded."""

    def __init__(self) -> None:
        self.peak = 0

    @contextmanager
    def lib(self) -> Iterator[None]:
        if not tracemalloc.is_tracing():
            yield
            return
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        try:
            yield
        finally:
            self.peak = max(self.peak, tracemalloc.get_traced_memory()[1] - base)


def parse_blob(
    blob: bytes, *, plan: bool = True, companions: Sequence[Header] = (), meter: Meter | None = None
) -> Outcome:
    """Run one in-memory input through the parser (and, if accepted, the planner with the other shards of
    its checkpoint, `companions`); return how far it got.

    A named error is an outcome; any other exception, a `Hang`, or a failed consistency check propagates.
    """
    from stagerd.engine import consolidate

    lib = (meter or Meter()).lib
    with time_limit():
        try:
            with lib():
                n, obj = parse_header_bytes("fuzz.safetensors", blob, len(blob))
        except ALLOWED as e:
            return Outcome("bytes", error_kind(e))
        try:
            with lib():
                h = validate_header("fuzz.safetensors", n, obj, len(blob))
        except ALLOWED as e:
            return Outcome("entries", error_kind(e))
        check_accepted(h, n, len(blob))
        try:
            with lib():
                offsets = parse_dcp_sharding_info(h)
        except ALLOWED as e:
            return Outcome("sharding", error_kind(e))
        assert set(offsets) == set(h.tensors)
        for name, offs in offsets.items():
            assert len(offs) == len(h.tensors[name].shape) and all(o >= 0 for o in offs)
        if not plan:
            return Outcome("accepted", "")
        try:
            with lib():
                p = consolidate.plan([*companions, h])
                p.index()
        except StagerdError as e:
            return Outcome("plan", error_kind(e))
        return Outcome("accepted", "")


def parse_file(path: Path, meter: Meter | None = None) -> Outcome:
    """`read_header` on a file, with the same oracle as `parse_blob` (no planning)."""
    lib = (meter or Meter()).lib
    with time_limit():
        try:
            with lib():
                h = read_header(path)
        except ALLOWED as e:
            return Outcome("file", error_kind(e))
        size = path.stat().st_size
        check_accepted(h, h.data_start - 8, size)
        try:
            parse_dcp_sharding_info(h)
        except ALLOWED as e:
            return Outcome("sharding", error_kind(e))
        return Outcome("accepted", "")


# ---------------------------------------------------------------------------------------------- seeds


@dataclass(frozen=True)
class Seed:
    """A real shard's header, split: the decoded JSON object and the data section bytes."""

    name: str
    obj: dict[str, Any] = dataclasses.field(repr=False)
    data: bytes = dataclasses.field(repr=False)
    # the other shards of the same checkpoint, for planning
    companions: tuple[Header, ...] = dataclasses.field(default=(), repr=False)

    @classmethod
    def from_file(cls, path: Path) -> Seed:
        return cls.from_bytes(path.read_bytes(), path.name)

    @classmethod
    def from_bytes(cls, raw: bytes, name: str = "input") -> Seed:
        """Split a safetensors file; ValueError (or struct.error) if it has no JSON object header."""
        (n,) = struct.unpack("<Q", raw[:8])
        obj = json.loads(raw[8 : 8 + n])
        if not isinstance(obj, dict):
            raise ValueError("header is not a JSON object")
        return cls(name, obj, raw[8 + n :])

    def blob(self) -> bytes:
        body = json.dumps(self.obj).encode()
        return struct.pack("<Q", len(body)) + body + self.data


def load_seeds(model_dir: Path) -> list[Seed]:
    """Every shard of a real DCP save, each with the validated headers of the others."""
    paths = sorted(model_dir.glob("*.safetensors"))
    headers = [read_header(p) for p in paths]
    return [
        dataclasses.replace(Seed.from_file(p), companions=tuple(headers[:i] + headers[i + 1 :]))
        for i, p in enumerate(paths)
    ]


# ---------------------------------------------------------------------------------------------- mutation
