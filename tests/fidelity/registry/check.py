"""One registry case, end to end in this process: build the tiny model, save it through the Stager with
`model=`, export it kept and in bf16 (the engine's own `build_export`, as the daemon runs it), and
compare each export with `save_pretrained` of the same weights (in bf16, as `from_pretrained` loads them
in bf16: what the class keeps in float32 stays so): names, dtypes, shapes, bytes, and the config's dtype."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from stagerd.contract import layout
from stagerd.contract.sharding import DEFAULT_MAX_SHARD_SIZE
from stagerd.engine.export import build_export
from stagerd.engine.source import open_source
from stagerd.errors import HubPlanError
from tests.fidelity import harness
from tests.fidelity.loaded import loaded_in
from tests.fidelity.registry import tiny
from tests.fidelity.registry.cases import Case

# A tiny config that still builds a bigger model than this missed a size field: refused, not built.
MAX_PARAMS = 3_000_000


class TooBig(Exception):
    pass


def build(case: Case) -> Any:
    """The tiny model of `case`, every floating-point parameter drawn at random (seeded)."""
    import torch
    import transformers

    cls = getattr(transformers, case.cls)
    for variant in range(tiny.variants(case.model_type)):  # the tweaks that fit this transformers
        try:
            cfg = _config(case, cls, variant)
            with torch.device("meta"):
                n = sum(p.numel() for p in cls(cfg).parameters())
            break
        except Exception:
            if variant + 1 == tiny.variants(case.model_type):
                raise
    if n > MAX_PARAMS:
        raise TooBig(f"{case.id}: the tiny config still makes {n} parameters")
    torch.manual_seed(0)
    model = cls(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype))
    model.eval()
    return model


def _config(case: Case, cls: Any, variant: int) -> Any:
    cfg = tiny.tiny_config(case.model_type, variant, **dict(case.over))
    if not isinstance(cfg, cls.config_class) and isinstance(
        cfg.get_text_config(decoder=True), cls.config_class
    ):
        cfg = cfg.get_text_config(decoder=True)  # a causal LM of a multimodal model type: its text model
    if case.tied:  # where the config allows it (some refuse tied embeddings)
        text = cfg.get_text_config(decoder=True)
        for c in {id(cfg): cfg, id(text): text}.values():
            c.tie_word_embeddings = True
            try:
                c.validate()
            except Exception:
                c.tie_word_embeddings = False
    return cfg


def check(case: Case, stager: Any, step: int, tmp: Path, model: Any = None) -> Any:
    """Run `case` (or `model`, built for it) as step `step` of `stager` (whose root is `tmp / "root"`);
    returns the model, which the caller keeps until the next case (the Stager caches a plan by the
    model's id)."""
    import torch

    if model is None:
        model = build(case)  # a tied case of a class that cannot tie: the model as its config builds it
    try:  # no extras: the config files are the model's, as save_pretrained writes them
        stager.save(model.state_dict(), step=step, model=model)
    except HubPlanError as e:  # name the registry ops whose conversion could not be planned
        raise AssertionError(
            f"{case.id}: {e.message} (registry ops: {', '.join(ops_of(model, e.message))})"
        ) from e
    stager.wait()
    step_dir = tmp / "root" / layout.step_dir_name(step)
    try:
        for mode, dtype in (("keep", None), ("bf16", "BF16")):
            out, ref = tmp / f"export-{mode}", tmp / f"ref-{mode}"
            out.mkdir()
            build_export(
                open_source(step_dir), out, dtype=dtype, keep_dtype=None, reference=None,
                max_shard_size=DEFAULT_MAX_SHARD_SIZE, threads=1, progress=None,
            )  # fmt: skip
            (model if dtype is None else loaded_in(model, torch.bfloat16)).save_pretrained(ref)
            harness.assert_same_tensors(out, ref)
            harness.assert_same_weight_files(out, ref)
            for name in ("config.json", "generation_config.json"):
                assert (out / name).is_file() == (ref / name).is_file(), name
                if (ref / name).is_file():
                    assert (out / name).read_bytes() == (ref / name).read_bytes(), (mode, name)
            if dtype is None:  # sharded as save_pretrained shards it: its splitter, its order, its index
                limit = max(1, sum(f.stat().st_size for f in out.glob("*.safetensors")) // 3)
                out_n, ref_n = tmp / "export-sharded", tmp / "ref-sharded"
                out_n.mkdir()
                build_export(
                    open_source(step_dir), out_n, dtype=None, keep_dtype=None, reference=None,
                    max_shard_size=limit, threads=1, progress=None,
                )  # fmt: skip
                model.save_pretrained(ref_n, max_shard_size=limit)
                harness.assert_same_weight_files(out_n, ref_n)
            assert harness.config_dtype(out) == harness.config_dtype(ref), mode
    finally:
        shutil.rmtree(step_dir, ignore_errors=True)
        for mode in ("keep", "bf16", "sharded"):
            shutil.rmtree(tmp / f"export-{mode}", ignore_errors=True)
            shutil.rmtree(tmp / f"ref-{mode}", ignore_errors=True)
    return model


def ops_of(model: Any, message: str) -> list[str]:
    """The registry ops (ConversionOps classes) of `model`'s conversions, those whose patterns name a
    tensor quoted in `message` first."""
    import re

    from transformers.conversion_mapping import get_model_conversion_mapping

    named = re.findall(r"'([^']+)'", message)
    ops: dict[str, bool] = {}
    transforms = getattr(model, "_weight_conversions", None) or get_model_conversion_mapping(model)
    for t in transforms:
        patterns = [*getattr(t, "source_patterns", []), *getattr(t, "target_patterns", [])]
        hit = any(_search(p, n) for p in patterns for n in named)
        for op in getattr(t, "operations", []):
            ops[type(op).__name__] = ops.get(type(op).__name__, False) or hit
    return sorted(ops, key=lambda n: not ops[n]) or ["none"]


def _search(pattern: str, name: str) -> bool:
    """`pattern` found in `name`; a target pattern with a group reference (`\\1`) is a replacement
    template, not a regex, and finds nothing."""
    import re

    try:
        return re.search(pattern, name) is not None
    except re.error:
        return False
