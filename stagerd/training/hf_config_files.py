"""`config.json` and `generation_config.json` as `model.save_pretrained` writes them, for a save that
passes the model but not those files: the export then loads with `from_pretrained` as it is.

transformers' own code writes them (`PretrainedConfig.save_pretrained`, `GenerationConfig.save_pretrained`)
on copies, after the two changes `save_pretrained` makes to the model's config first: `dtype` from the
model's parameters and `architectures` from its class. The model's own config is not touched.
"""

from __future__ import annotations

import copy
import logging
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger("stagerd.stager")

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"


def saved_config_files(model: Any, given: frozenset[str]) -> tuple[tuple[str, bytes], ...]:
    """(name, bytes) of the config files save_pretrained would write for `model`, except those `given`."""
    out: list[tuple[str, bytes]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="stagerd-config-") as tmp:
            if CONFIG not in given:
                config = copy.deepcopy(model.config)
                config.dtype = str(model.dtype).split(".")[1]
                config.architectures = [type(model).__name__.removeprefix("FSDP")]
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
