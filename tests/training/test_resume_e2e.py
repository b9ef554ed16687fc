"""Issue 13 end to end, bit for bit: train, publish raw, lose ROOT, restore a middle step, resume.

1. A 2-rank FSDP2 CPU run with AdamW trains steps 1..4, saving each through the Stager with the model and
   optimizer state from `get_state_dict`, and records its final state (the uninterrupted run).
2. `stagerd watch --publish-raw --once` pushes the steps to a file:// sink and to the S3 test server.
3. ROOT is deleted; `stagerd restore` brings step 2 back from S3 (and from file://, the same bytes).
4. A new 2-rank job calls `Stager.load` and `set_state_dict`, trains steps 3..4, and its final model and
   optimizer state equal the uninterrupted run's bit for bit. Each step's data comes from a generator
   seeded by the step.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from stagerd.contract import layout
from tests.cli_helpers import run_cli
from tests.daemon_helpers import fast_flags
from tests.gloo import join, launch
from tests.s3server import s3, s3_server  # noqa: F401  (fixtures)

pytestmark = pytest.mark.slow

STEPS, RESUME_FROM = 4, 2
FAST = fast_flags()


def _model_and_opt():
    from torch.distributed.fsdp import fully_shard

    from stagerd.demo.tiny_model import TinyLM

    torch.manual_seed(0)
    model = TinyLM()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train_step(model, opt, step: int, rank: int) -> None:
    from stagerd.demo.tiny_model import CONFIG, next_token_loss

    ids = torch.randint(
        0, CONFIG.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1000 * step + rank)
    )
    next_token_loss(model(ids[:, :-1]), ids[:, 1:]).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _record_final(model, opt, rank: int, path: Path) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        flat = {f"model.{k}": v.contiguous() for k, v in msd.items()}
        for fqn, state in osd["state"].items():
            flat.update({f"optim.{fqn}.{n}": torch.as_tensor(t).contiguous() for n, t in state.items()})
        save_file(flat, str(path))


def _run(rank: int, world: int, init_file: str, root: str, out: str, resume: bool) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from stagerd import Stager

    torch.set_num_threads(1)
    join(rank, world, init_file)
    try:
        model, opt = _model_and_opt()
        with Stager(root, checkpointer="thread") as stager:
            first = 1
            if resume:
                msd, osd = get_state_dict(model, opt)
                first = stager.load(msd, osd) + 1
                set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
                assert stager.loaded is not None and stager.loaded.json("data.json") == {"next": first}
            for step in range(first, STEPS + 1):
                _train_step(model, opt, step, rank)
                if not resume:
                    msd, osd = get_state_dict(model, opt)
                    stager.save(msd, step, optimizer_state=osd, extras={"data.json": {"next": step + 1}})
                    stager.wait_staged()
        _record_final(
            model, opt, rank, Path(out) / f"final-{'resumed' if resume else 'straight'}.safetensors"
        )
    finally:
        dist.destroy_process_group()


def _tree(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_resume_from_a_restored_middle_step_equals_the_uninterrupted_run(tmp_path, s3):  # noqa: F811
    root, out, files = tmp_path / "root", tmp_path / "out", tmp_path / "files"
    root.mkdir()
    out.mkdir()
    launch(_run, str(root), str(out), False)
    assert [s for s, _ in layout.committed_steps(root)] == list(range(1, STEPS + 1))
    r = run_cli(
        ["watch", root, "--sink", files.as_uri(), "--sink", s3.url("run"), "--publish-raw", "--once", *FAST],
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert (files / "raw" / "latest").read_text() == layout.step_dir_name(STEPS)
    shutil.rmtree(root)

    new, other = tmp_path / "new-root", tmp_path / "other-root"
    r = run_cli(["restore", s3.url("run"), new, "--step", str(RESUME_FROM)])
    assert r.returncode == 0, r.stderr
    r = run_cli(["restore", files.as_uri(), other, "--step", str(RESUME_FROM)])
    assert r.returncode == 0, r.stderr
    name = layout.step_dir_name(RESUME_FROM)
    assert _tree(new / name) == _tree(other / name)

    launch(_run, str(new), str(out), True)
    straight = load_file(out / "final-straight.safetensors")
    resumed = load_file(out / "final-resumed.safetensors")
    assert sorted(straight) == sorted(resumed)
    assert any(k.endswith(".exp_avg_sq") for k in straight) and any(k.endswith(".step") for k in straight)
    differ = [
        k
        for k in straight
        if not torch.equal(straight[k].view(-1).view(torch.uint8), resumed[k].view(-1).view(torch.uint8))
    ]
    assert not differ, differ
