"""What the Hub sink tests share: the test repo, the test server's small config, a small HF export,
a sink on the server, and an export's files as bytes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from stagerd.sinks.hub import HubSink
from tests.hubserver import HubConfig, HubServer

REPO = "acme/llm"
# Small enough for a fast test, big enough that the large shard goes multipart (3 parts) and the
# tree and commit listings span several pages.
CONFIG = HubConfig(
    multipart_threshold=256 * 1024, multipart_chunk_size=120 * 1024, tree_page_size=3, commits_page_size=2
)


def write_export(out: Path, *, seed: int = 0, shards: int = 2) -> Path:
    """A small HF export as save_pretrained lays it out: `shards` safetensors files (the first over the
    multipart threshold) with an index, or one `model.safetensors` without, and a config.json."""
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    weight_map, total = {}, 0
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors" if shards > 1 else "model.safetensors"
        rows = 160 if i == 0 else 10
        tensors = {f"layers.{i}.w": rng.standard_normal((rows, 1024), dtype=np.float32).astype(np.float16)}
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.nbytes for t in tensors.values())
    if shards > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps({"model_type": "llama", "seed": seed}))
    return out


def make_sink(hub: HubServer, url: str = f"hf://{REPO}", **options) -> HubSink:
    options = {
        "token": hub.token,
        "endpoint": hub.endpoint,
        "backoff_base": 0.01,
        "backoff_max": 0.05,
        **options,
    }
    return HubSink.from_url(url, **options)


def one_file_export(tmp_path: Path, seed: int) -> Path:
    """`write_export` of one `model.safetensors`, under `tmp_path/export-SEED`: a step's export for the tests
    whose upload path does not matter."""
    return write_export(tmp_path / f"export-{seed}", seed=seed, shards=1)


def export_files(export: Path) -> dict[str, bytes]:
    return {p.relative_to(export).as_posix(): p.read_bytes() for p in export.rglob("*") if p.is_file()}


@pytest.fixture(name="xet")
def lfs_only() -> bool:
    """For a module whose tests are about refs, not the upload path: LFS, the quicker one."""
    return False


@pytest.fixture(name="hub_config")
def default_hub_config() -> HubConfig:
    """The test server as the Hub is, without the small pages of `CONFIG`."""
    return HubConfig()
