"""NeMo AutoModel's offline consolidation vs stagerd's adopted export, on the same checkpoint bytes.

Generates a real AutoModel checkpoint (`save_consolidated: false`): AutoModel 0.7's own Llama, sharded
with its own FSDP2 `parallelize_model` on RANKS gloo CPU processes (built on the meta device, so no rank
ever holds the whole model), saved by its own `Checkpointer.save_model` into `epoch_0_step_1/model/`
(HuggingFaceStorageWriter shards + `.hf_metadata/`). Then, in paired rounds whose order alternates:

- automodel: the work of AutoModel's `tools/offline_hf_consolidation.py` (what the checkpoint's own
  `consolidate.sh` runs): `consolidate_safetensors_files_on_every_rank` from the installed wheel with the
  checkpoint's `fqn_to_file_index_mapping.json`, then the `.hf_metadata` files copied. The tool itself
  lives in AutoModel's repository, not in the wheel; `--automodel-tool PATH` runs that file instead.
- stagerd: `export_adopted(CKPT, OUT, AdoptOptions(preset="automodel"))`, the export `watch --adopt`
  runs (plan, copy, fsync, the checks that the source held still), without publishing.

Each runs in its own process (wall time, peak RSS via wait4, CPU); outputs are removed and `sync`ed
between runs, so every run starts from the same warm page cache. The first round's outputs are compared
tensor for tensor (names, dtypes, bytes). AutoModel's consolidation does not fsync its output; stagerd
fsyncs every file before the export counts as done.

    python bench/bench_adopt_automodel.py --size-gb 2 --rounds 5
Needs `pip install --no-deps nemo-automodel==0.7.0 torchdata==0.11.0` (see .ci/run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEP_DIR = "epoch_0_step_1"


def _rank(rank: int, world: int, init: str, out: str, layers: int) -> None:
    import torch
    import torch.distributed as dist
    import transformers as tf

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    from nemo_automodel.components.checkpoint.checkpointing import Checkpointer
    from nemo_automodel.components.checkpoint.config import CheckpointingConfig
    from nemo_automodel.components.distributed.config import FSDP2Config
    from nemo_automodel.components.distributed.mesh import MeshContext
    from nemo_automodel.components.distributed.model_parallelizer import parallelize_model
    from nemo_automodel.components.models.llama.model import LlamaForCausalLM

    cfg = tf.LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        dtype="bfloat16",
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = parallelize_model(model, MeshContext.build(FSDP2Config(), world_size=world))
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.copy_(torch.randn(local.shape, generator=g, dtype=torch.float32))
    ck = Checkpointer(
        CheckpointingConfig(
            checkpoint_dir=out, model_save_format="safetensors", save_consolidated=False, model_cache_dir=out
        ),
        dp_rank=rank,
        tp_rank=0,
        pp_rank=0,
    )
    ck.save_model(model, str(Path(out) / STEP_DIR))
    dist.destroy_process_group()


def _generate_here(out: Path, size_gb: float, ranks: int) -> None:
    import torch.multiprocessing as mp

    layers = max(1, round((size_gb * 1e9 - 2 * 32000 * 2048 * 2) / (103e6)))
    init = tempfile.mktemp(prefix="stagerd-bench-")
    mp.start_processes(_rank, args=(ranks, init, str(out), layers), nprocs=ranks, start_method="spawn")


def generate(out: Path, size_gb: float, ranks: int) -> Path:
    """In a child: the parent must stay small (no torch), since a child's peak RSS starts at ours."""
    subprocess.run([sys.executable, __file__, "--generate", str(out), str(size_gb), str(ranks)], check=True)
    return out / STEP_DIR


AUTOMODEL = """
import json, os, shutil, sys
from nemo_automodel.components.checkpoint._backports.consolidate_hf_safetensors import (
    consolidate_safetensors_files_on_every_rank,
)
model, out, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
meta = os.path.join(model, ".hf_metadata")
os.makedirs(out)
mapping = json.load(open(os.path.join(meta, "fqn_to_file_index_mapping.json")))
consolidate_safetensors_files_on_every_rank(model, out, mapping, num_threads=threads)
for name in os.listdir(meta):
    if name != "fqn_to_file_index_mapping.json":
        shutil.copy2(os.path.join(meta, name), os.path.join(out, name))
"""

STAGERD = """
import sys
from pathlib import Path
from stagerd.engine.adopt.export import export_adopted
from stagerd.engine.adopt.source import AdoptOptions
options = AdoptOptions(preset="automodel")
export_adopted(Path(sys.argv[1]), Path(sys.argv[2]), options, threads=int(sys.argv[3]))
"""


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float, float]:
    """(wall seconds, peak RSS MiB, CPU seconds) of a child process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, cwd=ROOT)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}")
    return wall, usage.ru_maxrss / 1024, usage.ru_utime + usage.ru_stime


def _tensors(d: Path) -> dict[str, tuple[Path, str, list[int], int, int]]:
    """name -> (file, dtype, shape, begin, end) from the safetensors headers under `d`."""
    out = {}
    for f in sorted(d.rglob("*.safetensors")):
        with open(f, "rb") as r:
            (n,) = struct.unpack("<Q", r.read(8))
            header = json.loads(r.read(n))
        header.pop("__metadata__", None)
        for name, e in header.items():
            b, end = e["data_offsets"]
            out[name] = (f, e["dtype"], e["shape"], 8 + n + b, 8 + n + end)
    return out


def same_tensors(a: Path, b: Path) -> int:
    """Compare two exports tensor for tensor, 1 MiB at a time (the parent stays small: a child's peak RSS
    starts at ours); returns the tensor count."""
    ta, tb = _tensors(a), _tensors(b)
    assert sorted(ta) == sorted(tb), (sorted(set(ta) ^ set(tb)))[:5]
    for name, (fa, dt, shape, ba, ea) in ta.items():
        fb, dtb, shapeb, bb, _ = tb[name]
        assert (dt, shape) == (dtb, shapeb), name
        with open(fa, "rb") as ra, open(fb, "rb") as rb:
            ra.seek(ba)
            rb.seek(bb)
            left = ea - ba
            while left:
                k = min(left, 1 << 20)
                assert ra.read(k) == rb.read(k), f"{name}: bytes differ"
                left -= k
    return len(ta)


def du(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="writer threads, both tools")
    ap.add_argument("--work", type=Path, default=ROOT / "bench" / "data" / "adopt-automodel")
    ap.add_argument("--keep", action="store_true", help="keep the generated checkpoint")
    ap.add_argument("--ckpt", type=Path, help="reuse a checkpoint made by an earlier --keep run")
    ap.add_argument("--automodel-tool", type=Path, help="AutoModel's tools/offline_hf_consolidation.py")
    args = ap.parse_args()

    if args.ckpt:
        ckpt, work = args.ckpt, args.ckpt.parent
    else:
        shutil.rmtree(args.work, ignore_errors=True)
        t0 = time.perf_counter()
        ckpt, work = generate(args.work, args.size_gb, args.ranks), args.work
        print(f"generated {du(ckpt / 'model') / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    t = str(args.threads)
    out = {"automodel": work / "out-automodel", "stagerd": work / "out-stagerd"}
    cmds = {
        "automodel": [sys.executable, "-c", AUTOMODEL, str(ckpt / "model"), str(out["automodel"]), t],
        "stagerd": [sys.executable, "-c", STAGERD, str(ckpt), str(out["stagerd"]), t],
    }
    if args.automodel_tool:
        cmds["automodel"] = [sys.executable, str(args.automodel_tool), "--backend", "gloo"]
        cmds["automodel"] += ["--num-threads", t, "--model-name", "none", "--input-dir", str(ckpt / "model")]
        cmds["automodel"] += ["--output-dir", str(out["automodel"])]
    res: dict[str, list[tuple[float, float, float]]] = {k: [] for k in cmds}
    for r in range(args.rounds + 1):  # round 0 warms the page cache and checks the outputs
        for tool in cmds if r % 2 == 0 else reversed(list(cmds)):
            shutil.rmtree(out[tool], ignore_errors=True)
            subprocess.run(["sync"], check=True)
            m = timed(cmds[tool], env)
            if r:
                res[tool].append(m)
        if r == 0:
            n = same_tensors(out["stagerd"] / "export", out["automodel"])
            print(f"outputs equal: {n} tensors, names, dtypes and bytes")
    for o in out.values():
        shutil.rmtree(o, ignore_errors=True)
    if not args.keep and not args.ckpt:
        shutil.rmtree(work, ignore_errors=True)

    def med(tool: str, i: int) -> float:
        return statistics.median(x[i] for x in res[tool])

    def span(tool: str, i: int) -> str:
        xs = [x[i] for x in res[tool]]
        return f"{min(xs):.2f}-{max(xs):.2f}"

    print(f"\nload average {os.getloadavg()[0]:.2f} (shared machine); {args.rounds} paired rounds")
    cols = ("tool", "wall s (median)", "wall min-max", "peak RSS MiB", "CPU s (median)", "vs automodel")
    print("| " + " | ".join(cols) + " |")
    print("|---|---|---|---|---|---|")
    for tool in cmds:
        ratio = statistics.median(s[0] / a[0] for s, a in zip(res[tool], res["automodel"], strict=True))
        print(
            f"| {tool} | {med(tool, 0):.2f} | {span(tool, 0)} | {med(tool, 1):.0f} | {med(tool, 2):.2f} "
            f"| {ratio:.2f}x |"
        )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--generate"]:
        _generate_here(Path(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
