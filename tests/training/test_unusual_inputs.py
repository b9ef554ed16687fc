"""Unusual but legal inputs round-trip bit for bit; inputs a step could not load back are refused at save.

Legal: keys with slashes, dots, quotes, unicode, the empty key and keys differing by case; strided,
expanded and overlapping views, 0-d and empty tensors, every dtype the installed safetensors reads back,
parameters with gradients, tensor subclasses, tied weights, a numpy integer step. Each comes back through
`Stager.load` and through the daemon's export (`stagerd consolidate`), byte for byte.

Refused by name, before anything is written: sparse, nested and mkldnn tensors (a bare
`NotImplementedError` from the host copy, naming no entry), a tensor named `__metadata__` (committed, then
neither the load nor the export could read the shard's header), a dtype the installed safetensors cannot
read back (F8_E8M0 before safetensors 0.8.x: committed, then the load failed), a frozenset among the
optimizer's values (passed as plain, then refused by the resume's unpickler), extras `a` beside `a/b` or
a name part too long for a file name (failed after `save()` returned, with a hint to free disk space), and
an extra named as a file the export writes itself (left out of the export, unsaid; `test_extras_names`).
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from stagerd.contract import layout
from stagerd.contract.dtypes import DTYPES
from stagerd.errors import LoadError, SaveInputError
from tests.gloo import join, launch


def _bits(t: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...], bytes]:
    t = t.detach().contiguous()
    return t.dtype, tuple(t.shape), bytes(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""


def _export(step_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    cli = "import sys; from stagerd.cli import main; sys.argv[0] = 'stagerd'; sys.exit(main())"
    run = subprocess.run(
        [sys.executable, "-c", cli, "consolidate", str(step_dir), str(out)], capture_output=True
    )
    assert run.returncode == 0, run.stderr.decode()
    got: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        got.update(load_file(f))
    return got


class _Tagged(torch.Tensor):
    pass


def _dtypes() -> list[torch.dtype]:
    return [
        getattr(torch, d.torch_name) for d in DTYPES.values() if d.torch_name and hasattr(torch, d.torch_name)
    ]


def test_unusual_keys_views_and_dtypes_round_trip_bit_for_bit(tmp_path):
    """Every dtype safetensors names either round-trips through the load and the export or is refused at
    save, naming its entry; never committed and unreadable."""
    from stagerd import Stager

    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    shared = torch.arange(10, dtype=torch.float32)
    param = torch.nn.Parameter(torch.arange(3.0))
    param.grad = torch.ones(3)
    sd: dict[str, torch.Tensor] = {
        "a/b": base.t(),  # transposed
        "ünï.权重": torch.arange(20.0)[::3],  # strided slice
        "": torch.tensor([1.0, 2.0]).expand(3, 2),  # stride 0
        'q"u\note': shared[0:6],  # overlaps the next
        "W": shared[3:10],
        "w": torch.tensor(3.5),  # 0-d; differs from "W" by case
        "empty": torch.empty(0, 3),
        "param": param,
        "grad": torch.arange(4.0).requires_grad_(),
        "tagged": torch.arange(5.0).as_subclass(_Tagged),
        "nan": torch.tensor([float("nan"), float("inf"), -0.0], dtype=torch.bfloat16),
    }
    refused = []
    with Stager(tmp_path / "probe") as stager:
        for i, dt in enumerate(_dtypes()):
            name = f"dtype.{str(dt).removeprefix('torch.')}"
            t = (
                torch.tensor([0, 1, 1, 0], dtype=torch.uint8).view(dt)
                if dt.itemsize == 1
                else torch.ones(4, dtype=dt)
            )
            try:
                stager.save({name: t}, i).result()
            except SaveInputError as e:
                assert f"entry {name!r} is {dt}" in e.message
                assert not (tmp_path / "probe" / layout.step_dir_name(i)).exists()
                refused.append(dt)
            else:
                sd[name] = t
    assert torch.float32 not in refused and torch.float8_e4m3fn not in refused
    root = tmp_path / "root"
    with Stager(root) as stager:
        marker = stager.save(sd, np.int64(7)).result()
        assert marker.step == 7 and type(marker.step) is int
        target = {k: torch.zeros_like(v.detach()) for k, v in sd.items()}
        assert stager.load(target, step=np.int64(7)) == 7
    for k, v in sd.items():
        assert _bits(target[k]) == _bits(v), k
    exported = _export(root / layout.step_dir_name(7), tmp_path / "out")
    assert {k: _bits(v) for k, v in exported.items()} == {k: _bits(v) for k, v in sd.items()}


def test_inputs_a_step_could_not_load_back_are_refused_by_name(tmp_path):
    from stagerd import Stager

    sd = {"w": torch.ones(2)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sparse CSR and nested tensors warn that they are prototypes
        cases = [
            ({"s": torch.ones(3).to_sparse()}, None, r"model state dict entry 's' is a sparse_coo tensor"),
            ({"w": torch.ones(2)}, {"c": torch.eye(2).to_sparse_csr()}, r"entry 'c' is a sparse_csr tensor"),
            ({"n": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])}, None, r"'n' is a nested"),
            (sd, {"j": torch.nested.nested_tensor([torch.ones(2)], layout=torch.jagged)}, r"'j' is a nested"),
            ({"k": torch.ones(2).to_mkldnn()}, None, r"entry 'k' is a _mkldnn tensor"),
            ({"__metadata__": torch.ones(2)}, None, r"entry '__metadata__' has the name safetensors gives"),
            (sd, {"__metadata__": torch.ones(2)}, r"optimizer_state entry '__metadata__' has the name"),
            (sd, {"g": [{"f": frozenset({1})}]}, r"value 'g\.0\.f' is a frozenset.*refuses"),
        ]
    with Stager(tmp_path) as stager:
        for model_sd, optim, match in cases:
            with pytest.raises(SaveInputError, match=match) as e:
                stager.save(model_sd, 1, optimizer_state=optim)
            assert "\n" not in e.value.message and e.value.hint
        with pytest.raises(
            SaveInputError, match=r"extras 'a' is a file, but extras 'a/b' puts it a directory"
        ):
            stager.save(sd, 1, extras={"a/b": {}, "a": {}})
        assert not (tmp_path / layout.step_dir_name(1)).exists()
        stager.save(sd, 1, optimizer_state={"g": [{"f": {1}}]}, extras={"a/b": {}, "a/c": b"x"}).result()


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(4, 3)
        self.head = torch.nn.Linear(3, 4, bias=False)
        self.head.weight = self.embed.weight


def test_a_tied_models_state_dict_loads_back(tmp_path):
    """`model.state_dict()` of a tied model holds one tensor under two keys, staged once: loading into a
    fresh model's state dict was a LoadError (`Missing key in checkpoint state_dict: head.weight`)."""
    from stagerd import Stager

    torch.manual_seed(0)
    saved, fresh = _Tied(), _Tied()
    with torch.no_grad():
        fresh.embed.weight.zero_()
    with Stager(tmp_path) as stager:
        marker = stager.save(saved.state_dict(), 1).result()
        assert list(marker.tensors or {}) == ["embed.weight"]
        stager.load(fresh.state_dict())
    assert torch.equal(fresh.head.weight, saved.embed.weight) and fresh.head.weight is fresh.embed.weight


def test_a_step_saved_untied_loads_into_a_tied_model_only_if_both_tensors_are_the_same(tmp_path):
    """Both keys staged (saved untied), loaded into a tied model: the tied copy was filled from the first
    key and the other key's different values were dropped, unsaid."""
    from stagerd import Stager

    weight = torch.arange(12.0).reshape(4, 3)
    with Stager(tmp_path) as stager:
        stager.save({"embed.weight": weight, "head.weight": weight + 1}, 1).result()
        stager.save({"embed.weight": weight, "head.weight": weight.clone()}, 2).result()
        fresh = _Tied()
        with pytest.raises(
            LoadError, match=r"holds 'embed\.weight' and 'head\.weight' as two different"
        ) as e:
            stager.load(fresh.state_dict(), step=1)
        assert "untied" in e.value.hint and "\n" not in str(e.value)
        stager.load(fresh.state_dict(), step=2)
    assert torch.equal(fresh.head.weight, weight) and fresh.head.weight is fresh.embed.weight


def _refusals_run(rank: int, world: int, init_file: str, root: str, out: str) -> None:
    import json

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from stagerd import Stager
    from stagerd.errors import StagerdError

    join(rank, world, init_file)
    mesh = init_device_mesh("cpu", (world,))
    emb = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
    sd = {"emb": emb, "head": emb}
    rec: dict[str, object] = {}
    with Stager(root) as stager:
        for label, kwargs in [
            (
                "sparse_on_1",
                {"state_dict": {**sd, "sp": torch.ones(2).to_sparse() if rank else torch.ones(2)}},
            ),
            ("dtype_on_0", {"state_dict": sd, "dtype": "int3"}),  # rank 0's dtype alone is read
            # rank 0's extras alone are written: a part too long for a file name failed while writing,
            # after save() returned, with a hint to free disk space
            ("long_extra_on_0", {"state_dict": sd, "extras": {"x" * 256: b"1"} if rank == 0 else {}}),
            # an extra the export writes itself was left out of the export, unsaid
            (
                "export_name_on_0",
                {"state_dict": sd, "extras": {"model.safetensors": b"1"} if rank == 0 else {}},
            ),
        ]:
            try:
                stager.save(step=1, **kwargs).result()
                rec[label] = None
            except StagerdError as e:
                rec[label] = [e.name, e.message, e.hint]
        stager.save(sd, 2).result()
        target = distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)])
        stager.load({"emb": target, "head": target})
        rec["tied"] = target.full_tensor().tolist()
        # saved untied, the head differing on rank 1's rows alone: every rank refuses the tied load
        head = distribute_tensor(
            torch.arange(8.0).reshape(4, 2) + torch.tensor([[0.0]] * 3 + [[1.0]]), mesh, [Shard(0)]
        )
        stager.save({"emb": emb, "head": head}, 3).result()
        try:
            stager.load({"emb": target, "head": target}, step=3)
        except StagerdError as e:
            rec["untied"] = [e.name, e.message]
    Path(out, f"rank{rank}.json").write_text(json.dumps(rec))


def test_a_refusal_on_one_rank_is_the_same_error_and_hint_on_every_rank(tmp_path):
    """The other ranks raised a SaveInputError with its generic hint whatever the refusing rank raised (a
    DTypeError, or the entry's own hint); now each rank raises the refusing rank's error class and hint."""
    import json

    out = tmp_path / "out"
    out.mkdir()
    launch(_refusals_run, str(tmp_path / "root"), str(out), world=2)
    recs = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    refusals = (("sparse_on_1", 1), ("dtype_on_0", 0), ("long_extra_on_0", 0), ("export_name_on_0", 0))
    for label, refusing in refusals:
        own, other = recs[refusing][label], recs[1 - refusing][label]
        assert own is not None and other is not None
        assert other[0] == own[0] and other[2] == own[2], (label, own, other)
        assert other[1] == f"rank {refusing} refused the save of step 1: {own[0]}: {own[1]}"
    assert (
        recs[1]["sparse_on_1"][0] == "SaveInputError"
        and "'sp' is a sparse_coo tensor" in recs[1]["sparse_on_1"][1]
    )
    assert recs[0]["dtype_on_0"][0] == "DTypeError"
    assert (
        recs[0]["long_extra_on_0"][0] == "SaveInputError"
        and "too long (256 bytes" in recs[0]["long_extra_on_0"][1]
    )
    assert recs[0]["export_name_on_0"][:2] == [
        "SaveInputError",
        "extras 'model.safetensors' names a file the export writes itself",
    ]
    assert "rename the extra" in recs[1]["export_name_on_0"][2]
    assert sorted(p.name for p in (tmp_path / "root").iterdir()) == [layout.step_dir_name(s) for s in (2, 3)]
    assert recs[0]["tied"] == recs[1]["tied"] == torch.arange(8.0).reshape(4, 2).tolist()
    for rec in recs:
        assert rec["untied"][0] == "LoadError" and "loading model/ failed on rank 1: " in rec["untied"][1]
        assert "holds 'emb' and 'head' as two different tensors" in rec["untied"][1]
