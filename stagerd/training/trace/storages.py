"""The storages save_pretrained sizes a model's tensors by, read from the model's real tensors.

save_pretrained's splitter (huggingface_hub's) sizes a tensor by its whole storage and keeps the tensors of
one storage in one file. Before it runs, `remove_tied_weights_from_state_dict` clones every tensor that
shares a storage with others without overlapping any of them. So in a model whose parameters are views into
one flat buffer (a contiguous-parameters optimizer, FSDP1's or ZeRO's flat buffers, `p.data =
flat[a:b].view_as(p)`), most tensors get storages of their own, but a tied pair (one area under two names)
keeps the buffer and is sized by all of it, as is a tensor alone in a larger storage. The trace's meta
tensors each have a storage of their own: this is what they lack. No byte is read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

# A storage as save_pretrained tells them apart (`id_tensor_storage`): its device, address and bytes
StorageKey = tuple[torch.device, int, int]


def kept_storages(state_dict: Mapping[str, Any]) -> dict[str, tuple[StorageKey, int]]:
    """For each tensor of a model's `state_dict` (its real tensors) that save_pretrained writes from a
    storage larger than itself, or from one it shares with another tensor it writes: that storage's key
    and bytes. Tensors of a distributed or meta model (DTensors, meta tensors) are gathered or have no
    storage: none of them is here."""
    groups: dict[StorageKey, list[tuple[int, int, str]]] = {}
    for name, t in state_dict.items():
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type == "meta":
            continue
        if not t.is_contiguous():  # save_pretrained's own overlap check (`view(-1)`) refuses it
            continue
        s = t.untyped_storage()
        start = t.data_ptr()
        groups.setdefault((t.device, s.data_ptr(), s.nbytes()), []).append(
            (start, start + t.nelement() * t.element_size(), name)
        )
    out: dict[str, tuple[StorageKey, int]] = {}
    for key, areas in groups.items():
        nbytes = key[2]
        for cluster in _overlapping(areas) if len(areas) > 1 else [areas]:
            start, stop, _ = cluster[0]
            if len(cluster) > 1 or stop - start != nbytes:
                out.update((name, (key, nbytes)) for _, _, name in cluster)
    return out


def _overlapping(areas: list[tuple[int, int, str]]) -> list[list[tuple[int, int, str]]]:
    """The areas of one storage in clusters that overlap (transformers' `_find_disjoint`): a cluster of
    one is cloned by save_pretrained, so only larger ones keep the storage."""
    clusters: list[list[tuple[int, int, str]]] = []
    last_stop = None
    for area in sorted(areas):
        if last_stop is None or area[0] >= last_stop:
            clusters.append([area])
        else:
            clusters[-1].append(area)
        last_stop = area[1] if last_stop is None else max(last_stop, area[1])
    return [c for c in clusters if len(c) > 1]
