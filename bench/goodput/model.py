"""The Llama the loop trains (built from a config, nothing downloaded) and one training step."""

from __future__ import annotations

from typing import Any

PRESETS = {
    "tiny": {"hidden": 128, "layers": 2, "inter": 344, "heads": 4, "vocab": 2048, "seq": 128, "batch": 4},
    "small": {"hidden": 512, "layers": 4, "inter": 1376, "heads": 8, "vocab": 8192, "seq": 256, "batch": 4},
    "1b": {"hidden": 2048, "layers": 16, "inter": 5632, "heads": 16, "vocab": 32000, "seq": 2048, "batch": 8},
}


def build(preset: dict, cuda: bool) -> tuple[Any, Any, Any]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=preset["hidden"],
        num_hidden_layers=preset["layers"],
        intermediate_size=preset["inter"],
        num_attention_heads=preset["heads"],
        num_key_value_heads=preset["heads"],
        vocab_size=preset["vocab"],
        max_position_embeddings=preset["seq"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    device = torch.device("cuda" if cuda else "cpu")
    with device:
        model: Any = LlamaForCausalLM(cfg)
    model = model.to(torch.bfloat16 if cuda else torch.float32)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)
    x = torch.randint(0, preset["vocab"], (preset["batch"], preset["seq"]), device=device)
    return model, optim, x


def train_step(model: Any, optim: Any, x: Any, method: Any, hidden: bool) -> Any:
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    if method is not None and hidden:
        method.before_step()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return loss


def state_bytes(model: Any, optim: Any) -> int:
    import torch

    n = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for st in optim.state.values():
        n += sum(t.numel() * t.element_size() for t in st.values() if isinstance(t, torch.Tensor))
    return n


def sync_device() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
