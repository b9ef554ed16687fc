"""`config.json` and `generation_config.json` as `model.save_pretrained` writes them, for a save that
passes the model but not those files: the export then loads with `from_pretrained` as it is.

transformers' own code writes them (`PretrainedConfig.save_pretrained`, `GenerationConfig.save_pretrained`)
on copies, after the two changes `save_pretrained` makes to the model's config first: `dtype` from the
model's parameters and `architectures` from its class. The model's own config is not touched.

The base model of a PEFT model exports as `merge_and_unload()` (`peft_plan.merged_plan`), so its config is
the merged model's: `dtype` from the merged model's parameters (a `modules_to_save` copy in place of its
original, LoRA matrices gone), and `tie_word_embeddings` false where merge_and_unload() sets it so (the
input and output embeddings' weights are two tensors once merged: a `modules_to_save` copy of a tied
weight without `ensure_weight_tying`). Nothing is merged: the merged model's parameters are looked up.
"""

from __future__ import annotations

import copy
import logging
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger("stagerd.stager")

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"


def saved_config_files(model: Any, given: frozenset[str]) -> tuple[tuple[str, bytes], ...]:
    """(name, bytes) of the config files save_pretrained would write for `model`, except those `given`;
    for a PEFT model's base model, those save_pretrained of its merge_and_unload() would write."""
    out: list[tuple[str, bytes]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="stagerd-config-") as tmp:
            if CONFIG not in given:
                config = copy.deepcopy(model.config)
                merged = _under_peft(model)
                # PreTrainedModel.dtype, of the merged model where that is what the export holds
                floats = (p.dtype for p in merged_parameters(model) if p.is_floating_point())
                dtype = next(floats) if merged else model.dtype
                config.dtype = str(dtype).split(".")[1]
                config.architectures = [type(model).__name__.removeprefix("FSDP")]
                if merged and _merge_unties(model):
                    config.tie_word_embeddings = False
                config.save_pretrained(tmp)
                out.append((CONFIG, (Path(tmp) / CONFIG).read_bytes()))
            generation = getattr(model, "generation_config", None)
            if GENERATION_CONFIG not in given and generation is not None and model.can_generate():
                copy.deepcopy(generation).save_pretrained(tmp)
                out.append((GENERATION_CONFIG, (Path(tmp) / GENERATION_CONFIG).read_bytes()))
    except Exception as e:  # a config transformers itself refuses to save: the export goes on without it
        log.warning("not writing the model's config files into the export: %s: %s", type(e).__name__, e)
        return ()
    return tuple(out)


def _under_peft(model: Any) -> bool:
    """`model` is a PEFT model's base model (PEFT sets its `peft_config`), not one with transformers' own
    adapters (`add_adapter`), whose save_pretrained writes the adapter alone."""
    return (
        "peft" in sys.modules
        and getattr(model, "peft_config", None) is not None
        and not getattr(model, "_hf_peft_config_loaded", False)
    )


def merged_parameters(model: Any) -> Iterator[Any]:
    """The parameters of `model` merged as merge_and_unload() merges it, in `parameters()`'s order, each
    once: each PEFT layer or wrapper replaced by the module merge_and_unload() puts in its place."""
    seen_modules: set[int] = set()
    seen: set[int] = set()

    def walk(module: Any) -> Iterator[Any]:
        module = merged_module(module)
        if id(module) in seen_modules:
            return
        seen_modules.add(id(module))
        for p in module._parameters.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                yield p
        for child in module._modules.values():
            if child is not None:
                yield from walk(child)

    return walk(model)


def merged_module(module: Any) -> Any:
    """The module merge_and_unload() puts in `module`'s place (`module` itself if none): a
    `modules_to_save` wrapper's active copy (its original without one), a trainable-tokens wrapper's
    embedding, a LoRA layer's base layer. Merging changes their values in place, not which tensors."""
    from peft.utils.other import ModulesToSaveWrapper, TrainableTokensWrapper

    if isinstance(module, ModulesToSaveWrapper):
        if not module.active_adapters:
            return module.original_module
        active: Any = module.active_adapter  # one name on a wrapper
        module = module.modules_to_save[active]
        return module.get_base_layer() if hasattr(module, "base_layer") else module
    if isinstance(module, TrainableTokensWrapper):
        return module.token_adapter.get_base_layer()
    return module.get_base_layer() if hasattr(module, "base_layer") else module


def _merge_unties(model: Any) -> bool:
    """merge_and_unload() sets `tie_word_embeddings=False`: the config ties them, and the merged model's
    input and output embeddings' weights are not one tensor."""
    try:
        if not model.config.to_dict().get("tie_word_embeddings"):
            return False
        ins, outs = model.get_input_embeddings(), model.get_output_embeddings()
    except (NotImplementedError, AttributeError):
        return False
    if ins is None or outs is None:
        return False
    a = getattr(merged_module(ins), "weight", None)
    b = getattr(merged_module(outs), "weight", None)
    if a is None or b is None or a is b:
        return False
    from stagerd.training.host_copy import local_tensor

    # PEFT's own test, on a DTensor's local shard: a DTensor's own data_ptr() is 0 (FSDP2's parameters),
    # so two sharded weights would look tied. FSDP2 keeps a tied weight one DTensor, its shard one storage.
    a, b = local_tensor(a), local_tensor(b)
    try:
        return bool(a is not b and a.data_ptr() != b.data_ptr())
    except RuntimeError:  # a tensor without storage of its own: two tensors, so untied
        return True
