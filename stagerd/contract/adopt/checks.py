"""Which checks an adopted export was made under, recorded with its options (`export.options.json`).

An export cached by a build whose checks differ (or by one from before this was recorded) may hold what
this build refuses, such as an adapter PEFT would load wrong (`peft_names.py`). It is rebuilt from the
trainer's checkpoint, and so checked again, before any sink gets it; one made by this build is reused.
Raise CHECKS whenever an adopted export's refusals or conversion change.
"""

from __future__ import annotations

CHECKS_KEY = "adopt_checks"  # its key among the recorded options
# 5: a config.json whose model has other shapes (or RoPE heads) than the checkpoint is refused;
# 4: a cast leaves what the model keeps in float32 (a MoE's router) as saved, whatever names it has;
# 3: the names, layout and order save_pretrained writes where config.json names the model (a MoE's experts
# split); 2: AutoModel's MoE LoRA refusals (grouped experts, a scaled rank); 1: any build before them
CHECKS = 5


def made_by_these_checks(recorded: object) -> bool:
    """Whether recorded options (None: no options file) say this build's checks made the export."""
    return isinstance(recorded, dict) and recorded.get(CHECKS_KEY) == CHECKS
