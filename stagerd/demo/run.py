"""`stagerd demo`: the whole pipeline on one machine, with no GPU and no network.

1. Train: 2 gloo processes train a tiny FSDP2 language model on CPU and save it through `stagerd.Stager`
   every step. Rank 0 also writes the full trained weights of each step to `expected/` (safetensors), so
   the check at the end compares against what training really held, not against the export itself.
2. Run the daemon: `stagerd watch ROOT --sink URL --once`, as a child process, exactly as an operator would.
3. Check: load every published step with `safetensors` and compare it bit for bit with `expected/`.

Layout of the demo directory: `staging/` (the ROOT), `published/` (the default file:// sink), `expected/`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.parse
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stagerd.contract import layout
from stagerd.errors import StagerdError, VerifyError
from stagerd.ops.progress import progress

WORLD = 2
MODEL_CONFIG = {
    "architectures": ["StagerdTinyLM"],
    "model_type": "stagerd-tiny",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "torch_dtype": "float32",
}


class DemoError(StagerdError):
    """A demo phase that failed; the message names the phase and the hint says where to look."""

    hint = "rerun with --debug; the demo directory is kept for inspection"


@dataclass(frozen=True)
class DemoPlan:
    """Where the demo writes and what it publishes to."""

    workdir: Path
    sinks: tuple[str, ...]
    steps: int = 3

    @property
    def staging(self) -> Path:
        return self.workdir / "staging"

    @property
    def published(self) -> Path:
        return self.workdir / "published"

    @property
    def expected(self) -> Path:
        return self.workdir / "expected"


@dataclass
class DemoResult:
    """What the demo did: the summary prints this."""

    plan: DemoPlan
    train_seconds: float = 0.0
    save_stall_seconds: list[float] = field(default_factory=list)
    watch_seconds: float = 0.0
    staged_bytes: dict[int, int] = field(default_factory=dict)
    status: list[dict[str, Any]] = field(default_factory=list)
    checked: dict[int, str] = field(default_factory=dict)  # step -> where the checked copy lives
    tensors: int = 0


def make_plan(root: Path | None, sinks: list[str] | None, steps: int = 3) -> DemoPlan:
    """A new temp directory unless `root` is given; the local file:// sink unless `sinks` are."""
    workdir = Path(tempfile.mkdtemp(prefix="stagerd-demo-")) if root is None else root.resolve()
    if root is not None and (workdir / "staging").exists() and any((workdir / "staging").iterdir()):
        raise DemoError(
            "already holds a demo run",
            path=workdir,
            hint="pass a new --root, or delete that directory first",
        )
    sinks = list(sinks or []) or [(workdir / "published").as_uri()]
    return DemoPlan(workdir=workdir, sinks=tuple(sinks), steps=steps)


# --------------------------------------------------------------------------------------- 1. training


def _tiny_lm():
    import torch
    from torch import nn

    c = MODEL_CONFIG
    h, heads = c["hidden_size"], c["num_attention_heads"]

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
                nn.Linear(h, h, bias=False) for _ in range(4)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            q, k, v = (
                p(x).view(b, t, heads, h // heads).transpose(1, 2)
                for p in (self.q_proj, self.k_proj, self.v_proj)
            )
            y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o_proj(y.transpose(1, 2).reshape(b, t, h))

    class Mlp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            i = c["intermediate_size"]
            self.gate_proj, self.up_proj = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False)
            self.down_proj = nn.Linear(i, h, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.input_layernorm, self.post_attention_layernorm = nn.RMSNorm(h), nn.RMSNorm(h)
            self.self_attn, self.mlp = Attention(), Mlp()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.self_attn(self.input_layernorm(x))
            return x + self.mlp(self.post_attention_layernorm(x))

    class Body(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(c["vocab_size"], h)
            self.layers = nn.ModuleList(Layer() for _ in range(c["num_hidden_layers"]))
            self.norm = nn.RMSNorm(h)

    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = Body()
            self.lm_head = nn.Linear(h, c["vocab_size"], bias=False)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.model.embed_tokens(ids)
            for layer in self.model.layers:
                x = layer(x)
            return self.lm_head(self.model.norm(x))

    return TinyLM()


def _train_rank(rank: int, world: int, init_file: str, plan: DemoPlan, report: str) -> None:
    """One training process: FSDP2 over gloo, a Stager save after every optimizer step."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.fsdp import fully_shard

    from stagerd.training.stager import Stager

    warnings.filterwarnings("ignore", category=UserWarning)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = _tiny_lm()
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        data = torch.Generator().manual_seed(1000 + rank)
        stager = Stager(root=str(plan.staging))
        stalls = []
        for step in range(1, plan.steps + 1):
            ids = torch.randint(0, MODEL_CONFIG["vocab_size"], (4, 32), generator=data)
            logits = model(ids[:, :-1])
            loss = nn_loss(logits, ids[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

            sd = model.state_dict()
            t0 = time.perf_counter()
            stager.save(sd, step=step, extras={"config.json": MODEL_CONFIG}, metadata={"run": "stagerd-demo"})
            stager.wait_staged()
            stalls.append(time.perf_counter() - t0)
            # The weights as training holds them now: what the published export must equal, bit for bit.
            full = {k: v.full_tensor().contiguous() for k, v in sd.items()}
            if rank == 0:
                plan.expected.mkdir(parents=True, exist_ok=True)
                save_file(full, str(plan.expected / f"{layout.step_dir_name(step)}.safetensors"))
        stager.wait()
        stager.close()
        if rank == 0:
            layout.write_json_atomic(report, {"save_stall_seconds": stalls})
    finally:
        dist.destroy_process_group()


def nn_loss(logits, targets):
    """Next-token cross-entropy."""
    import torch

    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def train(plan: DemoPlan, result: DemoResult) -> None:
    """Phase 1: a real 2-process gloo training run that stages `plan.steps` checkpoints."""
    import torch.multiprocessing as mp

    plan.staging.mkdir(parents=True, exist_ok=True)
    report = plan.workdir / "train-report.json"
    fd, init_file = tempfile.mkstemp(prefix="stagerd-demo-gloo-")
    os.close(fd)
    os.unlink(init_file)
    t0 = time.perf_counter()
    try:
        ctx = mp.start_processes(
            _train_rank,
            args=(WORLD, init_file, plan, str(report)),
            nprocs=WORLD,
            start_method="spawn",
            join=False,
        )
        with progress(f"train ({WORLD} gloo ranks) and stage", plan.steps, unit="steps") as bar:
            while not ctx.join(timeout=0.25):
                bar(len(layout.committed_steps(plan.staging)), plan.steps)
            bar(len(layout.committed_steps(plan.staging)), plan.steps)
    except mp.ProcessException as e:
        last = str(e).strip().splitlines()[-1]
        raise DemoError(f"training failed: {last}", path=plan.staging) from None
    finally:
        if os.path.exists(init_file):
            os.unlink(init_file)
    result.train_seconds = time.perf_counter() - t0
    result.save_stall_seconds = json.loads(report.read_text())["save_stall_seconds"]
    for step, step_dir in layout.committed_steps(plan.staging):
        result.staged_bytes[step] = sum(f.size for f in layout.read_marker(step_dir).files)
    if sorted(result.staged_bytes) != list(range(1, plan.steps + 1)):
        raise DemoError(f"expected steps 1..{plan.steps} committed, found {sorted(result.staged_bytes)}")


# ------------------------------------------------------------------------------------ 2. the daemon


def _stagerd(*args: str, env: dict[str, str] | None = None, capture: bool = False, timeout: float = 300):
    cmd = [sys.executable, "-m", "stagerd.cli", *args]
    return subprocess.run(
        cmd, env=env, capture_output=capture, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )


def run_daemon(plan: DemoPlan, result: DemoResult) -> None:
    """Phase 2: `stagerd watch ROOT --sink URL... --once`; its exit status says all steps published."""
    argv = ["watch", str(plan.staging), "--once"]
    for sink in plan.sinks:
        argv += ["--sink", sink]
    env = {**os.environ, "STAGERD_METRICS_PORT": "off"}  # two demos at once must not fight for a port
    t0 = time.perf_counter()
    proc = _stagerd(*argv, env=env)
    result.watch_seconds = time.perf_counter() - t0
    status = _stagerd("status", str(plan.staging), "--json", capture=True)
    if status.returncode == 0:
        result.status = json.loads(status.stdout)["steps"]
    if proc.returncode != 0:
        raise DemoError(
            f"`stagerd watch --once` exited {proc.returncode}: not every step was published",
            path=plan.staging,
            hint=f"see the log above and `stagerd status {plan.staging}`",
        )


# ------------------------------------------------------------------------------------- 3. the check


def _published_copy(plan: DemoPlan, step: int) -> tuple[Path, str]:
    """(directory to check, what it is): the first sink's copy of the step, read back from the store.

    A file:// sink is read in place; the Hub (at the tag `step-N`) and any other fsspec store (s3://...)
    are downloaded into `downloaded/`, with the client's usual environment (HF_ENDPOINT, HF_TOKEN, AWS_*).
    """
    name = layout.step_dir_name(step)
    sink = plan.sinks[0]
    local = plan.workdir / "downloaded" / name
    if sink.startswith("hf://"):
        from huggingface_hub import snapshot_download

        from stagerd.sinks.hub import step_tag

        parts = urllib.parse.urlsplit(sink)
        repo_id = f"{parts.netloc}{parts.path}".split("@")[0].strip("/")
        endpoint = urllib.parse.parse_qs(parts.query).get("endpoint", [None])[0]
        snapshot_download(repo_id, revision=step_tag(step), local_dir=local, endpoint=endpoint)
        return local, f"{_redact(sink)}@{step_tag(step)} (downloaded to {local})"
    if sink.startswith("file://"):
        path = Path(urllib.parse.unquote(urllib.parse.urlsplit(sink).path)) / name
        if not (path / layout.MANIFEST_NAME).is_file():
            raise VerifyError("the file:// sink holds no manifest for this step", path=path)
        return path, str(path)
    import fsspec

    fs, remote_root = fsspec.core.url_to_fs(sink)
    remote = f"{remote_root.rstrip('/')}/{name}"
    if not fs.exists(f"{remote}/{layout.MANIFEST_NAME}"):
        raise VerifyError(f"{_redact(sink)} holds no manifest for step {step}", path=remote)
    local.mkdir(parents=True, exist_ok=True)
    for path in fs.find(remote):
        rel = path[len(remote) + 1 :]
        layout.safe_relpath(rel, what="remote file", path=remote)
        (local / rel).parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(path, str(local / rel))
    return local, f"{_redact(sink)}/{name} (downloaded to {local})"


def _redact(url: str) -> str:
    from stagerd.sinks.objects import redact_url

    return redact_url(url)


def check(plan: DemoPlan, result: DemoResult) -> None:
    """Phase 3: every step loads with safetensors and equals the trained weights, byte for byte."""
    from safetensors import safe_open

    with progress("check against the trained weights", plan.steps, unit="steps") as bar:
        for step in range(1, plan.steps + 1):
            _check_step(plan, result, step, safe_open)
            bar(step, plan.steps)


def _check_step(plan: DemoPlan, result: DemoResult, step: int, safe_open) -> None:
    where, label = _published_copy(plan, step)
    index = json.loads((where / layout.INDEX_NAME).read_text())
    expected_file = plan.expected / f"{layout.step_dir_name(step)}.safetensors"
    with safe_open(str(expected_file), framework="pt") as exp:
        names = set(exp.keys())
        if set(index["weight_map"]) != names:
            diff = sorted(names ^ set(index["weight_map"]))
            raise VerifyError(f"step {step}: the export's tensors differ from training's: {diff}", path=where)
        for name in sorted(names):
            with safe_open(str(where / index["weight_map"][name]), framework="pt") as got:
                if not _bit_equal(got.get_tensor(name), exp.get_tensor(name)):
                    raise VerifyError(f"step {step}: {name} differs from the trained weights", path=where)
    result.checked[step] = label
    result.tensors = len(names)


def _bit_equal(a, b) -> bool:
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


# ------------------------------------------------------------------------------------------ the whole


def run_demo(plan: DemoPlan) -> DemoResult:
    """Train and stage, run the daemon once, check the output. Raises a StagerdError on any failure."""
    result = DemoResult(plan=plan)
    train(plan, result)
    run_daemon(plan, result)
    check(plan, result)
    return result


def _size(n: int | None) -> str:
    from rich.filesize import decimal

    return "-" if n is None else decimal(n)


def _secs(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}s"


def format_summary(result: DemoResult, total_seconds: float) -> str:
    """The human summary: what ran, how long it took, how big it was, where the output is."""
    plan = result.plan
    by_step = {row.get("step"): row for row in result.status}
    lines = [
        f"stagerd demo: {plan.steps} steps trained, staged, exported, published and checked "
        f"in {total_seconds:.1f}s",
        f"  demo directory  {plan.workdir}",
        f"  staging ROOT    {plan.staging}",
        *(f"  sink            {_redact(s)}" for s in plan.sinks),
        "",
        f"  {'step':>4}  {'staged':>9}  {'exported':>9}  {'save stall':>10}  {'export':>7}  {'publish':>7}  "
        f"{'state':<10}  checked copy",
    ]
    for i, step in enumerate(sorted(result.staged_bytes)):
        row = by_step.get(step, {})
        lanes = row.get("lanes") or []
        publish = max((lane.get("seconds") or 0.0 for lane in lanes), default=None)
        stall = result.save_stall_seconds[i] if i < len(result.save_stall_seconds) else None
        lines.append(
            f"  {step:>4}  {_size(result.staged_bytes[step]):>9}  {_size(row.get('export_bytes')):>9}  "
            f"{_secs(stall):>10}  {_secs(row.get('export_seconds')):>7}  {_secs(publish):>7}  "
            f"{row.get('state', '?'):<10}  {result.checked.get(step, '-')}"
        )
    lines += [
        "",
        f"  training + staging ({WORLD} gloo ranks, FSDP2, CPU): {result.train_seconds:.1f}s; "
        f"`stagerd watch --once`: {result.watch_seconds:.1f}s",
        f"  every step loads with safetensors and equals the trained weights bit for bit "
        f"({result.tensors} tensors per step)",
        f"  next: stagerd status {plan.staging}",
    ]
    return "\n".join(lines)
