"""Which tensor names an adopted export may carry, judged by PEFT's loader: a full model's export must not
carry a PEFT model's names (no `from_pretrained` of the base model would find its weights), and an
adapter's must carry only names `PeftModel.from_pretrained` loads.

NeMo AutoModel trains LoRA on a MoE's grouped experts as four tensors of its own per layer
(`GroupedExpertsLoRA`: `lora_gate_and_up_A` [experts, in, rank], `lora_gate_and_up_B` [experts, rank,
out], and `lora_down_A`/`_B`). For the models it validated (Qwen3-MoE among them) its save turns them into
PEFT's fused-expert layout (`experts.lora_A.weight` [rank * experts, in], `target_parameters` in
adapter_config.json), which is published as it is. For the others it writes them under these names: PEFT
drops keys it did not create without a word, so the published adapter would load with every expert left
untrained. Which transformers parameter each factor belongs to, and in what order its rows are, depends
on the model (a rename, a transpose, an interleaving of gate and up rows, a scale folded into the
experts), which the checkpoint does not say: stagerd cannot convert them exactly, so it refuses them.

With `moe_rank_scaling` (in its own automodel_peft_config.json beside the adapter) AutoModel trains the
experts' factors at rank r // experts per token (`apply_lora_to_linear_modules`: `dim //
n_activated_experts`, the model's top-k), yet writes r alone in adapter_config.json, no `rank_pattern`:
PEFT builds them at rank r and fails on the sizes. The experts' rank is in the tensors but their number
is not, so no `rank_pattern` can be written exactly: that adapter is refused too, unless the base model's
config.json (the trainer's, --extras or ROOT; read, never published with an adapter) routes each token to
one expert: r // 1 is r, and PEFT loads it as trained.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from stagerd.contract.pickle_depth import show
from stagerd.errors import AdoptError

AUTOMODEL_PEFT_CONFIG = "automodel_peft_config.json"  # read, never published (PEFT has no use for it)

# A PEFT model's own names: its LoRA factors and the frozen layers they wrap. Published under them, no
# `from_pretrained` of the base model finds its weights (it initialises them at random, with a warning).
_PEFT_NAME = re.compile(r".*\.(?:base_layer|lora_(?:A|B|embedding_A|embedding_B|magnitude_vector))(?:\.|$).*")
# The base config's experts per token, by the names AutoModel's models read (`n_activated_experts`).
TOP_K_FIELDS = (
    "num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_topk", "moe_top_k", "top_k_experts"
)  # fmt: skip
_GROUPED_EXPERT_LORA = re.compile(r".*\.lora_(?:gate_and_up|down)_[AB]")


def refuse_peft_names(names: list[str]) -> None:
    """A full model's export: none of its names may be a PEFT model's."""
    peft = sorted(n for n in names if _PEFT_NAME.fullmatch(n))
    if peft and len(peft) == len(names) and not any(".base_layer." in n for n in peft):
        raise AdoptError(
            f"this checkpoint holds a PEFT adapter alone in DCP ({peft[0]!r} and {len(peft) - 1} more), "
            "which this preset would export as a model: from_pretrained would load none of its weights",
            hint="--adopt hf-trainer publishes the adapter the HF Trainer saves under FSDP's "
            "SHARDED_STATE_DICT (checkpoint-N/pytorch_model_fsdp_0) as PEFT writes it, given its "
            "adapter_config.json (--extras DIR); the trainer's files were not touched",
        )
    if peft:
        raise AdoptError(
            f"these are a PEFT model's tensors ({peft[0]!r} and {len(peft) - 1} more): exported under these "
            "names, from_pretrained would load none of the model's weights",
            hint="save the merged model (merge_and_unload) in the checkpoint, or save through "
            "stagerd.Stager / StagerdCallback with model=, which export the merged model and the adapter; "
            "the trainer's files were not touched",
        )


def refuse_grouped_expert_lora(names: list[str]) -> None:
    """An adapter's export: none of its names may be AutoModel's grouped-expert LoRA (see the module)."""
    grouped = sorted(n for n in names if _GROUPED_EXPERT_LORA.fullmatch(n))
    if grouped:
        raise AdoptError(
            f"{grouped[0]!r} and {len(grouped) - 1} more are NeMo AutoModel's grouped-expert LoRA factors, "
            "which PeftModel.from_pretrained drops without a word (the experts would load untrained); "
            "their model's fused expert layout is not in the checkpoint, so they cannot be converted exactly",
            hint="train a model whose AutoModel export writes PEFT's fused-expert layout (target_parameters "
            "in adapter_config.json), or leave the experts out of the adapter's target_modules; the "
            "trainer's files were not touched",
        )


def experts_per_token(config: Mapping[str, Any] | None) -> int | None:
    """The top-k of a MoE's config.json, under the names AutoModel's models read it by; None if none."""
    text = None if config is None else config.get("text_config")  # a vision-language MoE's
    for c in (config, text):
        if not isinstance(c, Mapping):
            continue
        for field in TOP_K_FIELDS:
            k = c.get(field)
            if isinstance(k, int) and not isinstance(k, bool):
                return k
    return None


def refuse_scaled_expert_rank(
    automodel: Mapping[str, Any] | None,
    adapter_config: Mapping[str, Any],
    names: list[str],
    base_config: Callable[[], Mapping[str, Any] | None],
) -> None:
    """An AutoModel adapter whose experts' rank its adapter_config.json misstates (see the module);
    `base_config` reads the base model's config.json, where there is one."""
    if (
        automodel is None
        or automodel.get("moe_rank_scaling") is not True
        or adapter_config.get("rank_pattern")
    ):
        return
    experts = sorted(n for n in names if ".experts." in n)
    if not experts:
        return
    k, r = experts_per_token(base_config()), adapter_config.get("r")
    if k == 1:
        return  # trained at r // 1 = r, the rank adapter_config.json gives them
    rank = f"r // {k} = {r // k}" if isinstance(r, int) and k else "r // experts per token"
    one = "" if k else "; one routing each token to one expert is published given its config.json in --extras"
    raise AdoptError(
        f"AutoModel's moe_rank_scaling trained {experts[0]!r} and {len(experts) - 1} more at rank {rank}, "
        f"but adapter_config.json gives them r={show(r)} and no rank_pattern: PeftModel.from_pretrained "
        "would fail on their sizes",
        hint=f"train without moe_rank_scaling (give peft.dim the rank the experts should have){one}; "
        "the trainer's files were not touched",
    )
