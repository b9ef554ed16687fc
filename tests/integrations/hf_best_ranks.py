"""What each gloo rank of the best-model test does (`load_best_model_at_end`), in the launch of `hf_ranks`.

Under DDP and under Accelerate FSDP2, two trainings of one tiny Llama from the same seed, 2 steps, an
evaluation and a save at each, `metric_for_best_model="loss"` with `greater_is_better=True`: the loss
falls, so the best step is step 1, not the last. One run saves through `StagerdCallback`, the other is the
plain Trainer saving its own checkpoints. Rank 0 writes `best-<mode>.json`: the best steps and paths, and
whether each rank's final weights are the best step's (recorded at its save), not the last step's, and the
plain run's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.integrations import hf_ranks

MODES = ("fsdp2", "ddp")
STEPS = 2


def run(rank: int, out: Path) -> None:
    for mode in MODES:
        _mode(rank, mode, out / mode)


def _mode(rank: int, mode: str, out: Path) -> None:
    seen = _Weights()
    staged = train(mode, out / "stagerd", stagerd=out / "root", callbacks=[seen])
    plain = train(mode, out / "plain", stagerd=None, callbacks=[])
    import torch.distributed as dist

    final, other, state = hf_ranks._full(staged.model), hf_ranks._full(plain.model), staged.state
    mine = [_same(final, seen.at[state.best_global_step]), _same(final, seen.at[STEPS]), _same(final, other)]
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)  # each rank's weights: DDP's replicas, FSDP2's gathered shards
    if rank != 0:
        return
    best = json.loads((Path(state.best_model_checkpoint) / "extras" / "trainer_state.json").read_text())
    last = Path(state.best_model_checkpoint).parent / f"step-{STEPS:08d}" / "extras" / "trainer_state.json"
    result = {
        "best_global_step": state.best_global_step,
        "plain_best_global_step": plain.state.best_global_step,
        "best_model_checkpoint": state.best_model_checkpoint,
        "recorded_in_the_last_step": json.loads(last.read_text())["best_model_checkpoint"],
        "recorded_in_the_best_step": best["best_model_checkpoint"],
        "final_is_best": [r[0] for r in ranks],
        "final_is_last": [r[1] for r in ranks],
        "final_is_plain": [r[2] for r in ranks],
        "sharded": hf_ranks._sharded(staged.model),
        "output": sorted(p.name for p in (out / "stagerd").glob("*")),
    }
    (out.parent / f"best-{mode}.json").write_text(json.dumps(result))


def train(mode: str, out: Path, stagerd: Path | None, callbacks: list[Any]) -> Any:
    import transformers as tf

    from stagerd.integrations.transformers import StagerdCallback

    args = dict(
        output_dir=str(out), max_steps=STEPS, save_steps=1, eval_strategy="steps", eval_steps=1,
        logging_steps=1, per_device_train_batch_size=2, per_device_eval_batch_size=4, learning_rate=1e-2,
        use_cpu=True, report_to=[], disable_tqdm=True, seed=7, load_best_model_at_end=True,
        metric_for_best_model="loss", greater_is_better=True, save_total_limit=1,
    )  # fmt: skip
    if mode == "fsdp2":
        args.update(fsdp=True, fsdp_config=hf_ranks.FSDP2)
    ds, training_args = hf_ranks.dataset(), tf.TrainingArguments(**args)
    _accelerate_as(mode)  # once the arguments made Accelerate's state
    trainer = tf.Trainer(
        model=hf_ranks.model(0), args=training_args, train_dataset=ds,
        eval_dataset=ds.select(range(8)), data_collator=tf.DataCollatorForLanguageModeling(
            hf_ranks.tokenizer(), mlm=False), processing_class=hf_ranks.tokenizer(),
        callbacks=[*callbacks, *([StagerdCallback(root=stagerd)] if stagerd else [])],
    )  # fmt: skip
    assert trainer.is_fsdp_enabled == (mode == "fsdp2")
    trainer.train()
    return trainer


def _accelerate_as(mode: str) -> None:
    """FSDP2 on CPU needs Accelerate told it runs on an accelerator (`hf_ranks.fsdp_on_cpu`); DDP on CPU
    needs it told back, since that state lives on in the process."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if mode == "fsdp2":
        hf_ranks.fsdp_on_cpu()
    else:
        PartialState().distributed_type = DistributedType.MULTI_CPU


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class _Weights(hf_ranks._callback_base()):  # type: ignore[misc]
    """The whole weights at each save (every rank: gathering is collective)."""

    def __init__(self) -> None:
        self.at: dict[int, dict[str, Any]] = {}

    def on_save(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.at[state.global_step] = {k: v.clone() for k, v in hf_ranks._full(model).items()}
