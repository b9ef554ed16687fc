"""What each gloo rank of the Trainer tests does, for the HF `Trainer` and TRL's `SFTTrainer` alike.

Two trainings of one tiny Llama under Accelerate FSDP2 (attention dropout on, so the RNG states matter),
4 steps, a save every 2 steps through `StagerdCallback`:
- `full/`: uninterrupted; rank 0 writes `save_pretrained` of the weights at every save (`ref/step-N/`);
- `resumed/`: a ROOT holding only `full/`'s step 2 (copied whole, as a preempted run or `stagerd restore`
  leaves it), and a model from another seed: `trainer.train(resume_from_checkpoint=cb.resume(trainer))`
  goes on from step 2 to step 4.
Rank 0 writes `result.json`: the per-step losses of each run and whether the final weights agree.

`moe`: a tiny DeepSeek V3 trained in float32 under FSDP2 for one save, `StagerdCallback(dtype="bf16")`;
rank 0 writes `ref/`: `from_pretrained(<its save_pretrained>, dtype=bfloat16).save_pretrained()`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tests.fidelity import models
from tests.gloo import join

STEPS, EVERY, SEQ, SAMPLES = 4, 2, 12, 16
FSDP2 = {
    "version": 2,
    "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
    "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
    "reshard_after_forward": True,
}


def tokenizer() -> Any:
    """A word-level tokenizer over the tiny vocabulary, built in memory (nothing downloaded)."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(models.VOCAB)}, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", bos_token="t1", eos_token="t2")


def dataset() -> Any:
    import torch
    from datasets import Dataset

    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, models.VOCAB, (SAMPLES, SEQ), generator=g).tolist()
    return Dataset.from_dict({"input_ids": ids})


def model(seed: int) -> Any:
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    config = models.config("llama_tied")
    config.attention_dropout = 0.1
    return tf.AutoModelForCausalLM.from_config(config)


def moe_model() -> Any:
    """A dense layer, then a MoE layer whose router (gate weight, score bias) transformers keeps in float32
    under bf16; the router drawn, so a rounding of it would show."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    config = tf.DeepseekV3Config(
        vocab_size=models.VOCAB, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, q_lora_rank=16, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=64,
    )  # fmt: skip
    model = tf.DeepseekV3ForCausalLM(config)
    router = model.model.layers[1].mlp.gate
    with torch.no_grad():
        for t in (router.weight, router.e_score_correction_bias):
            t.normal_()
    return model


def train_moe(rank: int, out: Path) -> None:
    import torch
    import transformers as tf

    from stagerd.integrations.transformers import StagerdCallback

    args = tf.TrainingArguments(
        output_dir=str(out / "output"), max_steps=EVERY, save_steps=EVERY, per_device_train_batch_size=2,
        learning_rate=1e-2, use_cpu=True, report_to=[], disable_tqdm=True, seed=7, fsdp=True,
        fsdp_config={**FSDP2, "transformer_layer_cls_to_wrap": ["DeepseekV3DecoderLayer"]},
    )  # fmt: skip
    collator = tf.DataCollatorForLanguageModeling(tokenizer(), mlm=False)
    fsdp_on_cpu()
    trainer = tf.Trainer(model=moe_model(), args=args, train_dataset=dataset(), data_collator=collator,
                         callbacks=[StagerdCallback(root=out / "root", dtype="bf16")])  # fmt: skip
    trainer.train()
    weights = _full(trainer.model)
    if rank == 0:
        with torch.random.fork_rng():
            whole = tf.DeepseekV3ForCausalLM(trainer.model.config)
        whole.load_state_dict(weights)
        whole.generation_config = trainer.model.generation_config
        whole.save_pretrained(out / "fp32")
        loaded = tf.DeepseekV3ForCausalLM.from_pretrained(out / "fp32", dtype=torch.bfloat16)
        loaded.save_pretrained(out / "ref")
        (out / "result.json").write_text(json.dumps({"sharded": _sharded(trainer.model)}))


def train(kind: str, out: Path, root: Path, seed: int, resume: bool) -> Any:
    import transformers as tf

    from stagerd.integrations.transformers import StagerdCallback

    common: dict[str, Any] = dict(
        output_dir=str(out / "output"), max_steps=STEPS, save_steps=EVERY, logging_steps=1,
        per_device_train_batch_size=2, learning_rate=1e-2, use_cpu=True, report_to=[], disable_tqdm=True,
        seed=7, save_total_limit=1,
    )  # fmt: skip
    common.update(fsdp=True, fsdp_config=FSDP2)
    cb = StagerdCallback(root=root)
    callbacks: list[Any] = [cb, _Attached()]
    if not resume:
        callbacks.append(_Reference(out / "ref"))
    if kind == "sft":
        from trl import SFTConfig, SFTTrainer

        args = SFTConfig(**common, bf16=False, max_length=SEQ)
        fsdp_on_cpu()
        trainer = SFTTrainer(model=model(seed), args=args, train_dataset=dataset(),
                             processing_class=tokenizer(), callbacks=callbacks)  # fmt: skip
    else:
        args = tf.TrainingArguments(**common)
        collator = tf.DataCollatorForLanguageModeling(tokenizer(), mlm=False)
        fsdp_on_cpu()
        trainer = tf.Trainer(model=model(seed), args=args, train_dataset=dataset(), data_collator=collator,
                             processing_class=tokenizer())  # fmt: skip
        for c in callbacks:
            trainer.add_callback(c)  # the other way in: after the Trainer is made
    assert trainer.is_fsdp_enabled and trainer.accelerator.state.fsdp_plugin.fsdp_version == 2
    trainer.train(resume_from_checkpoint=cb.resume(trainer) if resume else None)
    return trainer


def fsdp_on_cpu() -> None:
    """Accelerate enables FSDP only for accelerator distributed types (MULTI_GPU, XPU, ...) and on CPU
    silently trains data-parallel as MULTI_CPU, although FSDP2 (`fully_shard`) runs on CPU with gloo. So
    the already-made `PartialState` is told it is MULTI_GPU before the Trainer builds its `Accelerator`:
    Accelerate then takes its FSDP2 path and the device stays `cpu`. Sharding, training and the state
    dicts are then the libraries' own code."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    state = PartialState()
    if state.distributed_type != DistributedType.MULTI_GPU:
        assert state.distributed_type == DistributedType.MULTI_CPU, state.distributed_type
        state.distributed_type = DistributedType.MULTI_GPU


def run(rank: int, world: int, init_file: str, kinds: list[str], out_dir: str) -> None:
    """Each of `kinds` ("trainer", "sft", "moe", "best": `hf_best_ranks`) in turn, under `out_dir/<kind>/`
    (one launch: one import)."""
    from tests.integrations import hf_best_ranks

    env = dict(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=world, LOCAL_WORLD_SIZE=world)  # as torchrun sets
    os.environ.update({k: str(v) for k, v in env.items()})
    join(rank, world, init_file)
    for kind in kinds:
        if kind == "best":
            hf_best_ranks.run(rank, Path(out_dir) / kind)
        elif kind == "moe":
            train_moe(rank, Path(out_dir) / kind)
        else:
            _run(rank, kind, Path(out_dir) / kind)


def _run(rank: int, kind: str, out: Path) -> None:
    import shutil

    import torch.distributed as dist

    from stagerd.contract import layout

    full = train(kind, out, out / "full", seed=0, resume=False)
    if rank == 0:
        name = layout.step_dir_name(EVERY)
        shutil.copytree(out / "full" / name, out / "resumed" / name)
    dist.barrier()
    resumed = train(kind, out, out / "resumed", seed=1, resume=True)
    same = _same_weights(full.model, resumed.model)
    if rank == 0:
        result: dict[str, Any] = {name: _losses(t) for name, t in (("full", full), ("resumed", resumed))}
        result["same_weights"] = same
        result["attached"] = [_attached_of(t) for t in (full, resumed)]
        result["sharded"] = [_sharded(t.model) for t in (full, resumed)]
        (out / "result.json").write_text(json.dumps(result))


def _losses(trainer: Any) -> dict[str, float]:
    return {str(h["step"]): h["loss"] for h in trainer.state.log_history if "loss" in h}


def _sharded(model: Any) -> bool:
    """Every parameter is a DTensor sharded over both ranks: FSDP2, not DDP's replicas."""
    from torch.distributed.tensor import DTensor, Shard

    return all(isinstance(p, DTensor) and p.placements == (Shard(0),) for p in model.parameters())


def _full(model: Any) -> dict[str, Any]:
    """The FSDP2 model's whole weights (collective: every rank)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def _same_weights(a: Any, b: Any) -> bool:
    import torch

    sa, sb = _full(a), _full(b)
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _callback_base() -> Any:
    from transformers import TrainerCallback

    return TrainerCallback


class _Reference(_callback_base()):  # type: ignore[misc]
    """save_pretrained of the weights each save holds: gathered from the shards, saved by rank 0 from an
    unsharded copy of the model (its config and generation config)."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_save(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        import torch
        import transformers as tf

        weights = _full(model)
        if int(os.environ["RANK"]) == 0:
            with torch.random.fork_rng():  # the training's generators must not move
                whole = tf.AutoModelForCausalLM.from_config(model.config)
            whole.load_state_dict(weights)
            whole.generation_config = model.generation_config  # the model's own, not one made anew
            whole.save_pretrained(self.out / f"step-{state.global_step}")


class _Attached(_callback_base()):  # type: ignore[misc]
    """Whether the optimizer the Trainer steps (inside Accelerate's wrapper) waits for the copy."""

    def on_step_end(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        from stagerd.integrations.hf_trainer import torch_optimizer

        hooks = torch_optimizer(optimizer)._optimizer_step_pre_hooks.values()
        self.attached = any(h.__module__ == "stagerd.training.optimizer_hook" for h in hooks)


def _attached_of(trainer: Any) -> bool:
    return next(c for c in trainer.callback_handler.callbacks if isinstance(c, _Attached)).attached
