"""What `watch --adopt` says of a checkpoint it would otherwise pass over in silence: one whose name gives
no step number (and a folder of such checkpoints, ROOT given one level too high), one finished in a layout
no preset reads (a pickled model or adapter), one exported with no config.json (the export keeps its
names; no loader reads it), one that is a single pickled file, and one the trainer's rotation deleted
before its export began.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from stagerd.contract.adopt.step_names import parse_step_name
from stagerd.contract.layout import ADAPTER_WEIGHTS_NAME

NO_STEP = "gives no step number; --adopt ignores it"
NO_STEP_CHECKPOINT = (
    "holds a DCP checkpoint (.metadata), but its name gives no step number, so --adopt ignores it: pass "
    "--adopt-step REGEX, whose group `step` is the step number in such names"
)
NO_CONFIG = (
    "no config.json beside the checkpoint, in --extras DIR or in ROOT (the HF Trainer writes none beside a "
    "SHARDED_STATE_DICT checkpoint), so the export keeps the checkpoint's names and from_pretrained cannot "
    "load it: pass --extras DIR holding the model's config.json and tokenizer (their save_pretrained(DIR))"
)
SINGLE_FILE = (
    "is one file (a torch.save pickle, never read): --adopt reads checkpoint directories; save a sharded "
    "(DCP) checkpoint, or save through StagerdCheckpointIO / StagerdCallback"
)
ROTATED = (
    "the checkpoint was deleted before it was exported: the trainer's own rotation (the HF Trainer's "
    "save_total_limit, ...) deleted it first, so this step is not published"
)
LOST_HINT = (
    "to publish every checkpoint, let the trainer keep more of them and delete them with "
    "`stagerd watch --adopt --delete-adopted --keep-last N` instead"
)
ROTATED_HINT = f"nothing to mend: the step is retired as lost; {LOST_HINT}"
SAID_NO_CONFIG: set[Path] = set()  # the ROOTs told, once each: every checkpoint of a run lacks it alike


def holds_checkpoints(directory: Path, custom: re.Pattern[str] | None) -> str | None:
    """Why a child of ROOT whose name gives no step number is more than a folder of logs: its own children
    are named as checkpoints (a run's `checkpoints/` holding `checkpoint-N`, ROOT given one level too
    high), so the user meant it as ROOT; else None."""
    try:
        names = sorted(n for n in os.listdir(directory) if parse_step_name(n, custom) is not None)
    except OSError:
        return None
    if not names:
        return None
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return (
        f"gives no step number, so --adopt ignores it, but it holds checkpoints ({shown}): --adopt reads "
        f"ROOT's own children only; pass it as ROOT (`stagerd watch {directory} --adopt ...`)"
    )


def holds_dcp(directory: Path, custom: re.Pattern[str] | None = None) -> bool:
    """A DCP `.metadata` in `directory` or one level down (the HF Trainer's `pytorch_model_fsdp_0/`,
    AutoModel's `model/`): a checkpoint a user would expect adopted, not a folder of logs. A child named as
    a checkpoint (torchtitan's `checkpoint/step-N/`) is a checkpoint of its own: `directory` is then a
    folder of checkpoints, ROOT given one level too high (`holds_checkpoints`), not one unnamed checkpoint."""
    try:
        if (directory / ".metadata").is_file():
            return True
        with os.scandir(directory) as entries:
            return any(
                e.is_dir(follow_symlinks=False)
                and parse_step_name(e.name, custom) is None
                and os.path.isfile(os.path.join(e.path, ".metadata"))
                for e in entries
            )
    except OSError:
        return False


# torch.save pickles of the model: Accelerate's `save_state(safe_serialization=False)`, its FSDP
# FULL_STATE_DICT, a Trainer saving with `save_safetensors=False` in the transformers releases that had it.
PICKLED_MODELS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "pytorch_model_fsdp.bin")


def unadoptable(ckpt: Path) -> str | None:
    """Why a checkpoint no preset reads is never exported, once its trainer has finished it (a model or
    a PEFT adapter pickled, an adapter where no layout reads it, or the HF Trainer's trainer_state.json
    beside no model a preset reads); else None."""
    pickled = [n for n in PICKLED_MODELS if (ckpt / n).is_file()]
    if pickled:
        return (f"holds the model as {pickled[0]} (a pickle, never read): save safetensors "
                "(safe_serialization=True, the default) or a sharded (DCP) checkpoint")  # fmt: skip
    if (ckpt / "adapter_model.bin").is_file():
        return ("holds a PEFT adapter as adapter_model.bin (a pickle, never read): save it with "
                "safe_serialization=True (PEFT's default), which --adopt hf-trainer exports")  # fmt: skip
    if (ckpt / ADAPTER_WEIGHTS_NAME).is_file():
        return ("holds a PEFT adapter in no layout of this --adopt preset: --adopt hf-trainer (or auto) "
                "exports one from the HF Trainer's checkpoint-N, finished by trainer_state.json")  # fmt: skip
    if (ckpt / "trainer_state.json").is_file():
        return "is finished (trainer_state.json) but holds no model layout an --adopt preset reads"
    return None
