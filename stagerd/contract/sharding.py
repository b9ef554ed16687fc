"""Assign tensors to output files. Pure: names and sizes in, an ordered list of files out.

With a reference index the reference's grouping is kept whatever its file naming; without one, tensors
are packed by size in natural key order. The same input always gives the same files.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from stagerd.contract.layout import WEIGHTS_NAME
from stagerd.errors import ReferenceIndexError

# save_pretrained's default since transformers 5 (the Hub's largest file): most models are one file.
DEFAULT_MAX_SHARD_SIZE = 50_000_000_000
# A fleet's unit of work is an output file, so it packs smaller files that its nodes can share (the
# default of transformers 4 and of huggingface_hub's own splitter).
FLEET_MAX_SHARD_SIZE = 5_000_000_000
_DIGITS = re.compile(r"(\d+)")
_OF = re.compile(r"(\d+)-of-(\d+)")


def natural_key(name: str) -> tuple[object, ...]:
    """Sort key that puts `layers.2` before `layers.10`. Splitting on digits alternates text and numbers.

    A number compares by (digit count without leading zeros, digits, length): the same order as int()
    without int()'s 4300-digit limit.
    """
    return tuple(
        (len(t.lstrip("0")), t.lstrip("0"), len(t)) if i % 2 else t for i, t in enumerate(_DIGITS.split(name))
    )


def output_file_names(n: int) -> list[str]:
    """`model.safetensors` for one file; else `model-00001-of-0000N.safetensors`, ..., as save_pretrained."""
    if n == 1:
        return [WEIGHTS_NAME]
    width = max(5, len(str(n)))
    return [f"model-{i:0{width}d}-of-{n:0{width}d}.safetensors" for i in range(1, n + 1)]


def parse_size(text: str | int) -> int:
    """`5GB` -> 5_000_000_000, `512MiB` -> 536_870_912, `1000` -> 1000."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"not a size: {text!r} (use e.g. 5GB, 500MB, 2GiB)")
    base = 1024 if m.group(3) else 1000
    power = " KMGT".index(m.group(2).upper() or " ")
    size = int(float(m.group(1)) * base**power)
    if size <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return size


def _pack(names: Sequence[str], sizes: Mapping[str, int], max_size: int, files: list[list[str]]) -> None:
    """Greedy fill in the given order: open a new file when the next tensor would overflow the last one."""
    current = files[-1] if files else None
    used = sum(sizes[n] for n in current) if current else 0
    for name in names:
        if current is None or (current and used + sizes[name] > max_size):
            current = []
            files.append(current)
            used = 0
        current.append(name)
        used += sizes[name]


def pack_by_size(sizes: Mapping[str, int], max_shard_size: int = DEFAULT_MAX_SHARD_SIZE) -> list[list[str]]:
    """Files filled up to max_shard_size in natural key order; an oversized tensor gets its own file."""
    files: list[list[str]] = []
    _pack(sorted(sizes, key=natural_key), sizes, max_shard_size, files)
    return files


def pack_in_order(
    names: Sequence[str],
    sizes: Mapping[str, int],
    max_shard_size: int,
    shared: Sequence[tuple[Sequence[str], int]] = (),
) -> list[list[str]]:
    """huggingface_hub's `split_state_dict_into_shards_factory`, which save_pretrained runs: tensors in the
    given order fill a file up to max_shard_size; one bigger than that gets a file of its own, placed
    before the file being filled, which goes on filling after it. `shared`: groups of names that are views
    of one storage of the given bytes there; a group is sized by that storage, at its first name in the
    order, and its other names join that name's file."""
    at = {n: i for i, n in enumerate(names)}
    size = dict(sizes)
    follow: dict[str, list[str]] = {}
    for group, nbytes in shared:
        first, *rest = sorted(group, key=at.__getitem__)
        size[first] = nbytes
        follow[first] = rest
    later = {n for rest in follow.values() for n in rest}
    files: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name in names:
        if name in later:
            continue
        if size[name] > max_shard_size:
            files.append([name])
            continue
        if used + size[name] > max_shard_size:
            files.append(current)
            current, used = [], 0
        current.append(name)
        used += size[name]
    if current:
        files.append(current)
    for f in files:
        f.extend([n for first in f if first in follow for n in follow[first]])
    return files


def reference_file_order(files: Sequence[str]) -> list[str]:
    """Reference files in order: by parsed `k-of-N` index if those are exactly 1..N, else by name."""
    parsed = {}
    for f in files:
        m = _OF.search(f)
        if m is None:
            break
        parsed[f] = int(m.group(1))
    if len(parsed) == len(files) and sorted(parsed.values()) == list(range(1, len(files) + 1)):
        return sorted(files, key=parsed.__getitem__)
    return sorted(files, key=natural_key)


def assign_with_reference(
    sizes: Mapping[str, int],
    weight_map: Mapping[str, str],
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
) -> list[list[str]]:
    """Keep the reference's grouping: N distinct reference files give N output files, in reference order.

    Keys absent from the reference are packed by size into the last file, then into new ones.
    Reference keys absent from the shards are an error.
    """
    missing = sorted((k for k in weight_map if k not in sizes), key=natural_key)
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ReferenceIndexError(
            f"{len(missing)} tensors of the reference index are not in the shards: {missing[:5]}{more}"
        )
    groups: dict[str, list[str]] = {}
    for key, fname in weight_map.items():
        groups.setdefault(fname, []).append(key)
    files = [sorted(groups[f], key=natural_key) for f in reference_file_order(list(groups))]
    extra = sorted((k for k in sizes if k not in weight_map), key=natural_key)
    _pack(extra, sizes, max_shard_size, files)
    return files
