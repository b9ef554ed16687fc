"""`verify` streams each export header: it never holds a header's decoded JSON or its entries, only the
index (or the one file's names) and the header's text. Structural bound only: RSS and time figures are in
BENCHMARKS.md (`bench/bench_verify.py`)."""

from __future__ import annotations

import gc
import tracemalloc

from stagerd.contract.safetensors_format import encode_header
from stagerd.engine.verify import verify_export


def test_verify_of_one_file_costs_a_few_hundred_bytes_per_tensor(tmp_path):
    """Before: the file's header decoded whole, twice over (its names, then its checks): about 1.2 kB
    per tensor at the peak (176 MiB of RSS at 100k tensors). Measured now: about 420 B."""
    n = 3000
    names = sorted(f"model.layers.{i}.mlp.weight" for i in range(n))
    entries = {name: ("F32", (2, 8), i * 64, (i + 1) * 64) for i, name in enumerate(names)}
    (tmp_path / "model.safetensors").write_bytes(encode_header(entries, {"format": "pt"}) + bytes(n * 64))
    del names, entries
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        r = verify_export(tmp_path)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert r.tensors == n
    assert peak / n < 750, peak / n
