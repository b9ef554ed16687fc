"""Run one trainer on 2 gloo ranks, once per test module, and describe what it left behind.

`produce(kind, tmp)` trains and checkpoints with the real library (`hf_trainer`, `lightning`,
`automodel`), then returns where the checkpoint, the reference `save_pretrained` and the extras are.
`snapshot` describes a folder byte for byte, to show later that nothing in it changed.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.adopt.trainers import tiny
from tests.daemon_helpers import free_port
from tests.gloo import launch


@dataclass(frozen=True)
class Produced:
    kind: str
    root: Path  # what `stagerd watch --adopt` is pointed at: the trainer's output folder
    checkpoint: Path  # the one checkpoint of the run (step tiny.STEPS)
    ref: Path  # save_pretrained of the trained weights
    extras: Path | None  # config.json and generation_config.json kept by the user, where the trainer has none


def _rank_fn(kind: str) -> Callable[..., None]:
    if kind == "hf_trainer":
        from tests.adopt.trainers.hf_trainer import train
    elif kind == "lightning":
        from tests.adopt.trainers.lightning_run import train
    elif kind == "automodel":
        from tests.adopt.trainers.automodel_run import train
    else:
        raise ValueError(kind)
    return train


def checkpoint_name(kind: str) -> str:
    return {
        "hf_trainer": f"checkpoint-{tiny.STEPS}",
        "lightning": f"checkpoints/epoch=0-step={tiny.STEPS}.ckpt",
        "automodel": f"epoch_0_step_{tiny.STEPS}",
    }[kind]


def produce(kind: str, tmp: Path) -> Produced:
    root, ref = tmp / "train", tmp / "ref"
    launch(_rank_fn(kind), str(root), str(ref), free_port(), world=2, deadline_s=240)
    extras = None
    if kind == "hf_trainer":  # under FSDP SHARDED_STATE_DICT the Trainer writes no config.json
        import transformers as tf

        extras = tmp / "extras"
        tiny.write_extras(tf.AutoConfig.from_pretrained(ref), extras)
    elif kind == "lightning":  # a Lightning user keeps the HF config beside the checkpoints
        import transformers as tf

        tiny.write_extras(tf.AutoConfig.from_pretrained(ref), root / "checkpoints")
    return Produced(kind, root, root / checkpoint_name(kind), ref, extras)


def snapshot(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every regular file, or `-> target` of every symlink, under `root`."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "-> " + os.readlink(p)
            elif p.is_file():
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                out[rel] = "dir"
    return out
