"""Which tensor names an adopted export may carry, judged by PEFT's loader: a full model's export must not
carry a PEFT model's names (no `from_pretrained` of the base model would find its weights).
"""

from __future__ import annotations

import re

from stagerd.errors import AdoptError

# A PEFT model's own names: its LoRA factors and the frozen layers they wrap. Published under them, no
# `from_pretrained` of the base model finds its weights (it initialises them at random, with a warning).
_PEFT_NAME = re.compile(r".*\.(?:base_layer|lora_(?:A|B|embedding_A|embedding_B|magnitude_vector))(?:\.|$).*")


def refuse_peft_names(names: list[str]) -> None:
    """A full model's export: none of its names may be a PEFT model's."""
    peft = sorted(n for n in names if _PEFT_NAME.fullmatch(n))
    if peft:
        raise AdoptError(
            f"these are a PEFT model's tensors ({peft[0]!r} and {len(peft) - 1} more): exported under these "
            "names, from_pretrained would load none of the model's weights",
            hint="save the merged model (merge_and_unload) in the checkpoint, or save through "
            "stagerd.Stager / StagerdCallback with model=, which export the merged model and the adapter; "
            "the trainer's files were not touched",
        )
