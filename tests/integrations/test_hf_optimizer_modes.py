"""An optimizer with train and eval modes (schedule-free, `optim="schedule_free_adamw"`): the Trainer calls
`optimizer.eval()` before evaluating, which writes the evaluation weights into the parameters, saves, and
calls `optimizer.train()` at the next training step, before its forward, which writes the training
weights back in place: no optimizer step comes between the save and that write. Each step staged through
`StagerdCallback` must hold the weights the Trainer's own checkpoint holds.

The optimizer is a small SGD with schedule-free's two sequences (`schedule_free`), in the real Trainer,
on CPU, one process; the model is wide enough (8 MiB) for its copy to take a while."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.integrations.hf_ranks import dataset, tokenizer
from tests.integrations.schedule_free import ScheduleFreeSGD

STEPS, EVERY = 4, 2


def _trainer(out: Path, callbacks: list[Any]) -> Any:
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=96, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=4)  # fmt: skip
    model = tf.AutoModelForCausalLM.from_config(config)
    args = tf.TrainingArguments(
        output_dir=str(out), max_steps=STEPS, save_steps=EVERY, eval_strategy="steps", eval_steps=EVERY,
        per_device_train_batch_size=2, use_cpu=True, report_to=[], disable_tqdm=True, seed=7,
    )  # fmt: skip
    optimizer = ScheduleFreeSGD(model.parameters())
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    collator = tf.DataCollatorForLanguageModeling(tokenizer(), mlm=False)
    return tf.Trainer(model=model, args=args, train_dataset=dataset(), eval_dataset=dataset().select([0, 1]),
                      data_collator=collator, optimizers=(optimizer, schedule),
                      callbacks=callbacks)  # fmt: skip


def test_a_step_saved_in_eval_mode_holds_the_weights_of_the_trainers_own_checkpoint(tmp_path):
    from safetensors.torch import load_file
    from transformers import TrainerCallback

    from stagerd import Stager
    from stagerd.integrations.transformers import StagerdCallback

    _trainer(tmp_path / "plain", []).train()
    stagerd = StagerdCallback(root=tmp_path / "root")
    copied: list[bool] = []

    class Copied(TrainerCallback):
        """Right after each save: whether its copy is done (the next training step's forward writes)."""

        def on_save(self, *args: Any, **kwargs: Any) -> None:
            try:
                stagerd.stager.wait_staged(timeout=0)
                copied.append(True)
            except TimeoutError:
                copied.append(False)

    trainer = _trainer(tmp_path / "output", [stagerd, Copied()])
    trainer.train()
    assert copied == [True] * (STEPS // EVERY)
    with Stager(tmp_path / "root") as stager:
        for step in range(EVERY, STEPS + 1, EVERY):
            own = load_file(tmp_path / "plain" / f"checkpoint-{step}" / "model.safetensors")
            staged = {k: torch.empty_like(v) for k, v in own.items()}
            stager.load(staged, step=step)
            assert all(torch.equal(staged[k], own[k]) for k in own), step
