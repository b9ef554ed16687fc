"""`Stager.load` (issue 13): a committed step back into sharded state dicts, agreed by every rank.

One 2-rank run saves steps 1 and 2 (model DTensors, an optimizer-like state with a non-tensor, extras);
a second 2-rank run loads them back (newest, a given step, refusals that every rank raises alike, a step
saved by one process), and single-process loads cover 2 -> 1 ranks, an HF export and the allowlist.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from stagerd.contract import commit_marker, layout
from stagerd.errors import LoadError
from tests.gloo import join, launch
from tests.training.gloo_run import dtensors, full_state, params, record, train_step


def _optim(sd: dict[str, torch.Tensor], scale: float) -> dict:
    return {
        **{f"state.{k}.exp_avg": v * scale for k, v in sd.items()},
        "param_groups.0.lr": 0.5 * scale,
    }


def _save_run(rank: int, world: int, init_file: str, root: str, out: str) -> None:
    from stagerd import Stager

    join(rank, world, init_file)
    sd = dtensors(world, rank)
    with Stager(root) as stager:
        for step in (1, 2):
            full = full_state(sd)
            if rank == 0:
                save_file(full, str(Path(out) / f"expected-{step}.safetensors"))
            stager.save(
                sd, step, extras={"loader.json": {"pos": step * 10}}, optimizer_state=_optim(sd, step)
            )
            stager.wait()
            train_step(sd, step)


def _exp_avg(opt: dict) -> dict[str, torch.Tensor]:
    return {k[len("state.") : -len(".exp_avg")]: v for k, v in opt.items() if k.startswith("state.")}


def _zeros(world: int, rank: int) -> dict[str, torch.Tensor]:
    sd = dtensors(world, rank)
    for v in sd.values():
        v.to_local().zero_()
    return sd


def _outcome(fn) -> str | None:
    try:
        fn()
    except LoadError as e:
        return str(e)
    return None


def _load_run(rank: int, world: int, init_file: str, root: str, single: str, out: str) -> None:
    from stagerd import Stager

    join(rank, world, init_file)
    rec: dict = {}
    with Stager(root) as stager:
        sd, opt = _zeros(world, rank), _optim(_zeros(world, rank), 0.0)
        rec["latest"] = stager.load(sd, opt)
        rec["extras"] = stager.loaded.json("loader.json")
        rec["lr"] = opt["param_groups.0.lr"]
        full = full_state(sd)
        exp = full_state(_exp_avg(opt))
        if rank == 0:
            save_file(full, str(Path(out) / "loaded-2.safetensors"))
            save_file(exp, str(Path(out) / "loaded-2-exp_avg.safetensors"))
        sd = _zeros(world, rank)
        rec["step1"] = stager.load(sd, step=1)
        if rank == 0:
            save_file(full_state(sd), str(Path(out) / "loaded-1.safetensors"))
        else:
            full_state(sd)
        rec["absent"] = _outcome(lambda: stager.load(sd, step=9))
        rec["mixed"] = _outcome(lambda: stager.load(sd, step=1 if rank == 0 else 2))
    with Stager(single) as stager:  # saved by one process, loaded by two: DCP reshards
        sd = _zeros(world, rank)
        rec["single"] = stager.load(sd)
        if rank == 0:
            save_file(full_state(sd), str(Path(out) / "loaded-single.safetensors"))
        else:
            full_state(sd)
    # node-local roots: rank 1's root lacks step 2
    os.environ["STAGERD_NODE_ID"] = f"node-{rank}"
    with Stager(Path(out) / f"node-{rank}") as stager:
        sd = _zeros(world, rank)
        rec["newest_missing"] = _outcome(lambda: stager.load(sd))
        rec["step_missing"] = _outcome(lambda: stager.load(sd, step=2))
        rec["no_optim"] = _outcome(lambda: stager.load(sd, {"x": torch.zeros(1)}, step=0))
    record(Path(out), rank, rec)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("load-root")
    out = tmp_path_factory.mktemp("load-out")
    launch(_save_run, str(root), str(out))
    single = tmp_path_factory.mktemp("load-single")
    from stagerd import Stager

    with Stager(single) as stager:  # one process, full tensors
        stager.save({k: t.clone() for k, (t, _) in params(2).items()}, 3)
    for rank, steps in ((0, (1, 2)), (1, (1,))):
        for s in steps:
            name = layout.step_dir_name(s)
            shutil.copytree(root / name, out / f"node-{rank}" / name)
    # a step without optim/, on both node roots
    for rank in (0, 1):
        shutil.copytree(single / layout.step_dir_name(3), out / f"node-{rank}" / layout.step_dir_name(0))
        _renumber(out / f"node-{rank}" / layout.step_dir_name(0), 0)
    launch(_load_run, str(root), str(single), str(out))
    recs = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return root, out, recs


def _renumber(step_dir: Path, step: int) -> None:
    m = json.loads((step_dir / layout.MARKER_NAME).read_text())
    m["step"] = step
    (step_dir / layout.MARKER_NAME).write_text(json.dumps(m))


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_loads_the_newest_step_model_optimizer_and_extras(runs):
    _, out, recs = runs
    assert [r["latest"] for r in recs] == [2, 2]
    assert [r["extras"] for r in recs] == [{"pos": 20}, {"pos": 20}]
    assert [r["lr"] for r in recs] == [1.0, 1.0]
    _same(load_file(out / "loaded-2.safetensors"), load_file(out / "expected-2.safetensors"))
    exp = {k: v * 2 for k, v in load_file(out / "expected-2.safetensors").items()}
    _same(load_file(out / "loaded-2-exp_avg.safetensors"), exp)


def test_loads_a_given_step(runs):
    _, out, recs = runs
    assert [r["step1"] for r in recs] == [1, 1]
    _same(load_file(out / "loaded-1.safetensors"), load_file(out / "expected-1.safetensors"))


def test_a_step_no_rank_sees_is_the_same_error_on_every_rank(runs):
    recs = runs[2]
    assert recs[0]["absent"] == recs[1]["absent"]
    assert (
        "step 9 is not committed under ROOT on any rank; its committed steps, newest first: 2, 1"
        in (recs[0]["absent"])
    )
    assert recs[0]["mixed"] == recs[1]["mixed"] and "different loads" in recs[0]["mixed"]


def test_a_step_only_some_ranks_see_is_the_same_error_on_every_rank(runs):
    recs = runs[2]
    for key, text in (
        ("newest_missing", "the newest committed step, 2, is not under ROOT on rank 1"),
        ("step_missing", "step 2 is committed under ROOT on some ranks but not on rank 1"),
        ("no_optim", "has no optim/: it was saved without optimizer_state"),
    ):
        assert recs[0][key] == recs[1][key], key
        assert text in recs[0][key], recs[0][key]


def test_a_step_saved_by_one_process_loads_on_two_ranks(runs):
    _, out, recs = runs
    assert [r["single"] for r in recs] == [3, 3]
    _same(load_file(out / "loaded-single.safetensors"), {k: t for k, (t, _) in params(2).items()})


def test_a_step_saved_by_two_ranks_loads_in_one_process(runs):
    from stagerd import Stager

    root, out, _ = runs
    want = load_file(out / "expected-2.safetensors")
    sd = {k: torch.zeros_like(v) for k, v in want.items()}
    opt = {**{f"state.{k}.exp_avg": torch.zeros_like(v) for k, v in want.items()}, "param_groups.0.lr": 0.0}
    with Stager(root) as stager:
        assert stager.load(sd, opt) == 2
    _same(sd, want)
    _same(_exp_avg(opt), {k: v * 2 for k, v in want.items()})


def test_resuming_from_an_older_step_says_what_the_later_steps_mean(runs, caplog):
    """A run rolled back (after a loss spike, say) into a ROOT with later steps is told so when it resumes,
    not only at each save it then skips; loading an older step's weights alone (an evaluation) says
    nothing."""
    from stagerd import Stager

    root, out, _ = runs
    want = load_file(out / "expected-1.safetensors")
    sd = {k: torch.zeros_like(v) for k, v in want.items()}
    opt = {**{f"state.{k}.exp_avg": torch.zeros_like(v) for k, v in want.items()}, "param_groups.0.lr": 0.0}
    with Stager(root) as stager, caplog.at_level("WARNING", logger="stagerd.load"):
        stager.load(sd, step=1)
        assert not caplog.records
        stager.load(sd, opt, step=1)
        stager.load(sd, opt)  # the newest: nothing later
    [said] = [r.getMessage() for r in caplog.records]
    assert said.startswith("resuming from step 1 while ROOT holds the later step(s) 2: this run's saves"), (
        said
    )
    assert "a resume without a step picks step 2; give a rolled-back run a ROOT of its own" in said, said


def test_no_step_to_load_names_root_and_what_it_holds(tmp_path):
    """A step not there (one the daemon's --keep-last deleted, say), a typo'd ROOT (which the Stager made,
    for a new run's first save), an empty ROOT, one of other files: each LoadError names ROOT and what it
    holds."""
    from stagerd import Stager
    from stagerd.training.step_choice import choose_step

    sd, real, typo = {"w": torch.ones(4)}, tmp_path / "ckpt", tmp_path / "ckpy"
    with Stager(real) as stager:
        for step in (1, 2):
            stager.save(sd, step)
        stager.wait()
        with pytest.raises(LoadError) as e:
            stager.load(sd, step=5)
    assert (
        str(e.value)
        == f"{real}: step 5 is not committed under ROOT on any rank; its committed steps, newest first: 2, 1"
    )
    assert "--keep-last" in e.value.hint
    with Stager(typo) as stager, pytest.raises(LoadError) as e:
        stager.load(sd)
    made = "it did not exist until this Stager made it"
    assert str(e.value) == f"{typo}: no committed step under ROOT on any rank: {made}; did you mean {real}?"
    with pytest.raises(LoadError, match=f"{tmp_path / 'nope'}: no committed step .*: it does not exist\n"):
        choose_step([[]], None, tmp_path / "nope")
    with pytest.raises(LoadError, match="step 3 is not committed under ROOT on any rank: it is empty\n"):
        choose_step([[], []], 3, typo)
    (typo / "checkpoint-10").mkdir()
    with pytest.raises(LoadError, match="it holds no step directories, only checkpoint-10\n"):
        choose_step([[]], None, typo)


def test_loads_a_published_hf_export(runs, tmp_path):
    from stagerd import Stager
    from stagerd.engine.export import export_step

    root, out, _ = runs
    step_dir = tmp_path / layout.step_dir_name(2)
    shutil.copytree(root / step_dir.name, step_dir)
    export_step(step_dir, dtype="fp32")
    want = load_file(out / "expected-2.safetensors")
    sd = {k: torch.zeros_like(v) for k, v in want.items()}
    with Stager(tmp_path / "other-root") as stager:
        stager.load_export(step_dir / layout.EXPORT_DIR, sd)
        with pytest.raises(LoadError, match="not an HF export"):
            stager.load_export(tmp_path, sd)
    _same(sd, {k: v.float().to(want[k].dtype) for k, v in want.items()})


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/stagerd-pwned-by-metadata",))


def test_optim_metadata_is_read_with_an_allowlist(tmp_path):
    from stagerd.training.safe_metadata import read_dcp_metadata

    marker = Path("/tmp/stagerd-pwned-by-metadata")
    marker.unlink(missing_ok=True)
    with pytest.raises(LoadError, match=r"refusing to unpickle posix\.system"):
        read_dcp_metadata(pickle.dumps(_Evil()), "optim/.metadata")
    assert not marker.exists()
    with pytest.raises(LoadError, match="unreadable"):
        read_dcp_metadata(b"\x80\x04garbage", "optim/.metadata")
    with pytest.raises(LoadError, match="not a Metadata"):
        read_dcp_metadata(pickle.dumps({"a": 1}), "optim/.metadata")


class _Touch:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _save_with_dcp_optim(root: Path, optim: dict) -> None:
    """Step 1 under `root`, its optim/ rewritten in DCP's own format (as an earlier stagerd wrote it)."""
    import dataclasses

    import torch.distributed.checkpoint as dcp

    from stagerd import Stager

    with Stager(root) as stager:
        stager.save({"w": torch.randn(3)}, 1, optimizer_state={"state": {}, "param_groups": []}).result()
    step_dir = root / layout.step_dir_name(1)
    shutil.rmtree(step_dir / "optim")
    for p in step_dir.glob("*.objects.pt"):
        p.unlink()
    dcp.save(optim, checkpoint_id=str(step_dir / "optim"), no_dist=True)
    marker = commit_marker.read_marker(step_dir)
    files = [
        f for f in marker.files if not f.path.startswith("optim/") and not f.path.endswith(".objects.pt")
    ]
    files += [
        commit_marker.StagedFile(f"optim/{p.name}", p.stat().st_size)
        for p in sorted((step_dir / "optim").iterdir())
    ]
    (step_dir / layout.MARKER_NAME).unlink()
    commit_marker.write_marker(step_dir, dataclasses.replace(marker, files=tuple(files)))
    assert (step_dir / "optim" / ".metadata").is_file()


def test_a_step_whose_optim_is_in_dcps_own_format_still_loads(tmp_path):
    """Steps saved before optim/ became safetensors (or restored from a sink) keep loading."""
    from stagerd import Stager

    optim = {"state": {"w": {"exp_avg": torch.randn(3)}}, "param_groups": [{"lr": 0.5, "betas": (0.9, 0.99)}]}
    _save_with_dcp_optim(tmp_path, optim)
    got = {"state": {"w": {"exp_avg": torch.zeros(3)}}, "param_groups": [{"lr": 0.0, "betas": (0.0, 0.0)}]}
    with Stager(tmp_path) as stager:
        stager.load({"w": torch.zeros(3)}, got)
    assert torch.equal(got["state"]["w"]["exp_avg"], optim["state"]["w"]["exp_avg"])
    assert got["param_groups"] == optim["param_groups"]


def test_a_dcp_format_optim_value_that_runs_code_is_refused(tmp_path):
    """DCP's own load planner reads non-tensor values with `torch.load(weights_only=False)`: a replaced
    `optim/__0_0.distcp` of such a step could run code in every rank that resumes from it."""
    from stagerd import Stager

    pwned = tmp_path / "pwned"
    evil = {"state": {"w": {"exp_avg": torch.randn(3)}}, "param_groups": [{"lr": _Touch(pwned)}]}
    _save_with_dcp_optim(tmp_path / "root", evil)
    got = {"state": {"w": {"exp_avg": torch.zeros(3)}}, "param_groups": [{"lr": 0.0}]}
    with (
        Stager(tmp_path / "root") as stager,
        pytest.raises(LoadError, match=r"refusing the value of 'param_groups"),
    ):
        stager.load({"w": torch.zeros(3)}, got)
    assert not pwned.exists()


def test_optim_specs_lists_every_tensor_of_either_format_with_its_global_shape(runs, tmp_path):
    """What a trainer integration builds its load templates from, without the state dicts at hand: a
    reader of optim/'s earlier DCP format alone saw no tensor in a step the Stager writes today, so a
    resumed Trainer silently got the model back without its optimizer, scheduler and RNG states."""
    from stagerd import Stager
    from stagerd.training.loader import optim_specs

    root, out, _ = runs
    want = load_file(out / "expected-2.safetensors")  # 2 ranks, each optimizer tensor sharded
    specs = optim_specs(root / layout.step_dir_name(2))
    assert specs == {f"state.{k}.exp_avg": (v.dtype, tuple(v.shape)) for k, v in want.items()}

    odd = {
        "step": torch.tensor(3.0),  # AdamW's 0-dim step
        "flag": torch.tensor(True),
        "count": torch.tensor(7, dtype=torch.int64),
        "half": torch.ones(2, 3, dtype=torch.bfloat16),
        "rng": torch.get_rng_state(),
        "none": torch.empty(0, 4),
        "lr": 0.1,  # not a tensor: not listed
    }
    with Stager(tmp_path / "one") as stager:
        stager.save({"w": torch.ones(2)}, 1, optimizer_state=odd).result()
    specs = optim_specs(tmp_path / "one" / layout.step_dir_name(1))
    assert specs == {k: (v.dtype, tuple(v.shape)) for k, v in odd.items() if k != "lr"}

    _save_with_dcp_optim(tmp_path / "dcp", {"state": {"w": {"exp_avg": torch.ones(3)}}, "lr": 0.5})
    assert optim_specs(tmp_path / "dcp" / layout.step_dir_name(1)) == {
        "state.w.exp_avg": (torch.float32, (3,))
    }
    assert optim_specs(root / "no-such-step") == {}


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    second = {"params": model[1].parameters(), "lr": 0.01, "weight_decay": 0.0}
    return torch.optim.AdamW([{"params": model[0].parameters()}, second])


def test_an_optimizer_state_with_no_room_for_the_saved_moments_is_refused(tmp_path):
    """`optimizer.state_dict()` of an optimizer that never stepped has an empty `state`: loading a step
    into it loaded the learning rates and dropped every saved moment and step count in silence, so the
    resumed run started Adam from zero. Now a `LoadError` says so; a state that has them loads bit for bit."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from stagerd import Stager

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = _adamw(model)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    with Stager(tmp_path) as stager:
        stager.save(model.state_dict(), 1, optimizer_state={"optim": opt.state_dict()}).result()
        fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        fresh_opt = _adamw(fresh)
        with pytest.raises(LoadError, match=r"no place for 12 tensors optim/ holds \('optim\.state\.0\."):
            stager.load(fresh.state_dict(), {"optim": fresh_opt.state_dict()})
        get_state_dict(fresh, fresh_opt)  # creates the optimizer's state, as the README's load does
        plain = {"optim": fresh_opt.state_dict()}  # now it has a place for every moment
        assert stager.load(fresh.state_dict(), plain) == 1
    fresh_opt.load_state_dict(plain["optim"])
    want, got = opt.state_dict(), fresh_opt.state_dict()
    assert want["param_groups"] == got["param_groups"]
    for i, state in want["state"].items():
        for k, v in state.items():
            assert torch.equal(v, got["state"][i][k]), (i, k)
