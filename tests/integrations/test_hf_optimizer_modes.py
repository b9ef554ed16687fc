"""An optimizer with train and eval modes (schedule-free, `optim="schedule_free_adamw"`): the Trainer calls
`optimizer.eval()` before evaluating, which writes the evaluation weights into the parameters, saves, and
calls `optimizer.train()` at the next training step, before its forward, which writes the training
weights back in place: no optimizer step comes between the save and that write. Each step staged through
`StagerdCallback` must hold the weights the Trainer's own checkpoint holds. So with the Trainer's
layer-wise optimizers (`optim="galore_adamw_layerwise"`, ...): each parameter steps in a hook during the
backward, and the optimizer the Trainer steps (`LayerWiseDummyOptimizer`) does nothing, so no wait at its
step comes before the next backward writes the parameters.

The optimizer is a small SGD with schedule-free's two sequences (`schedule_free`), in the real Trainer,
on CPU, one process; the model is wide enough (8 MiB) for its copy to take a while."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integrations.hf_ranks import dataset, tokenizer
from tests.integrations.schedule_free import ScheduleFreeSGD

STEPS, EVERY = 4, 2


def _layer_wise(model: Any) -> torch.optim.Optimizer:
    """The optimizer the Trainer builds for its layer-wise modes (`Trainer.get_optimizer_cls_and_kwargs`):
    one optimizer per parameter, stepped by a post-accumulate-grad hook; SGD in place of GaLore's."""
    from transformers.trainer_pt_utils import LayerWiseDummyOptimizer

    per_param = {p: torch.optim.SGD([p], lr=0.05) for p in model.parameters() if p.requires_grad}

    def step(param: torch.Tensor) -> None:
        if param.grad is not None:
            per_param[param].step()
            per_param[param].zero_grad()

    for param in per_param:
        param.register_post_accumulate_grad_hook(step)
    return LayerWiseDummyOptimizer(optimizer_dict=per_param, lr=0.05)


def _trainer(out: Path, callbacks: list[Any], layer_wise: bool = False) -> Any:
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=96, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=4)  # fmt: skip
    model = tf.AutoModelForCausalLM.from_config(config)
    args = tf.TrainingArguments(
        output_dir=str(out), max_steps=STEPS, save_steps=EVERY, eval_strategy="steps", eval_steps=EVERY,
        per_device_train_batch_size=2, use_cpu=True, report_to=[], disable_tqdm=True, seed=7,
    )  # fmt: skip
    optimizer = _layer_wise(model) if layer_wise else ScheduleFreeSGD(model.parameters())
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    collator = tf.DataCollatorForLanguageModeling(tokenizer(), mlm=False)
    return tf.Trainer(model=model, args=args, train_dataset=dataset(), eval_dataset=dataset().select([0, 1]),
                      data_collator=collator, optimizers=(optimizer, schedule),
                      callbacks=callbacks)  # fmt: skip


@pytest.mark.parametrize("layer_wise", [False, True], ids=["schedule-free", "layer-wise"])
def test_a_step_saved_in_eval_mode_holds_the_weights_of_the_trainers_own_checkpoint(tmp_path, layer_wise):
    from safetensors.torch import load_file
    from transformers import TrainerCallback

    from stagerd import Stager
    from stagerd.integrations.transformers import StagerdCallback

    _trainer(tmp_path / "plain", [], layer_wise).train()
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

    trainer = _trainer(tmp_path / "output", [stagerd, Copied()], layer_wise)
    trainer.train()
    assert copied == [True] * (STEPS // EVERY)
    with Stager(tmp_path / "root") as stager:
        for step in range(EVERY, STEPS + 1, EVERY):
            own = load_file(tmp_path / "plain" / f"checkpoint-{step}" / "model.safetensors")
            staged = {k: torch.empty_like(v) for k, v in own.items()}
            stager.load(staged, step=step)
            assert all(torch.equal(staged[k], own[k]) for k in own), step


def test_a_layer_wise_run_resumes_from_its_staged_step_as_from_the_trainers_own(tmp_path):
    """A layer-wise step holds the model, the scheduler and the RNG states (the per-parameter optimizers'
    state is in neither checkpoint): resumed from step 2 it ends where resuming from the Trainer's own
    `checkpoint-2` ends."""
    from safetensors.torch import load_file

    from stagerd.integrations.transformers import StagerdCallback

    _trainer(tmp_path / "plain", [], layer_wise=True).train()
    _trainer(tmp_path / "plain", [], layer_wise=True).train(
        resume_from_checkpoint=str(tmp_path / "plain" / f"checkpoint-{EVERY}")
    )
    own = load_file(tmp_path / "plain" / f"checkpoint-{STEPS}" / "model.safetensors")
    _trainer(tmp_path / "output", [StagerdCallback(root=tmp_path / "root")], layer_wise=True).train()
    stagerd = StagerdCallback(root=tmp_path / "root")
    trainer = _trainer(tmp_path / "output", [stagerd], layer_wise=True)
    trainer.train(resume_from_checkpoint=str(tmp_path / "root" / f"step-{EVERY:08d}"))
    got = trainer.model.state_dict()
    assert all(torch.equal(got[k], own[k]) for k in own)
