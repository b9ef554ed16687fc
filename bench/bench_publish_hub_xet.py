"""What a step costs on the wire through Xet: the sink against huggingface_hub's own `create_commit` of every
file (what stagerd did before it left unchanged files out, and what `upload_folder` does), on the same data.

    python bench/bench_publish_hub_xet.py --model-mb 256 --rounds 5

A synthetic LoRA fine-tune's export: `--shards` safetensors shards of `--model-mb` in all, the first
opening with a frozen embedding of `--embed-mb`, and an adapter file of `--adapter-mb`. Step 1 is published,
then step 2 after one of three changes:

- `lora`: only the adapter changed (the base model is frozen);
- `frozen-embedding`: every weight changed but the embedding, which sits at the start of shard 1;
- `full`: every byte changed (a full re-upload).

Step 2 goes from a `fresh` pod (a new process with an empty `HF_XET_CACHE`, as a sidecar's `HF_HOME` is on
every pod start) or a `warm` one (the cache that published step 1). Every publish runs in a new process;
the time is that of the publish call alone. The stagerd and huggingface_hub runs alternate, in turn
order switched every round, on the same files against one Hub test server on this machine (no network):
bytes are the server's count of xorb and shard bytes received. The real Hub's global deduplication may
send fewer bytes than this server, which has none, for chunks it has seen anywhere before.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
MB = 1 << 20
CHANGES = ("lora", "frozen-embedding", "full")
PODS = ("fresh", "warm")
WHO = ("stagerd", "huggingface_hub")


def _save(path: Path, tensors: dict[str, bytes]) -> None:
    from safetensors.numpy import save_file

    save_file({k: np.frombuffer(v, dtype=np.float16) for k, v in tensors.items()}, str(path))


def make_export(out: Path, args: argparse.Namespace, seed: int, *, keep: Path | None, change: str) -> Path:
    """Step 1 (`keep` None), or step 2 from step 1's files in `keep` after `change`."""
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True)
    per = (args.model_mb - args.embed_mb) * MB // args.shards
    for i in range(args.shards):
        name = f"model-{i + 1:05d}-of-{args.shards:05d}.safetensors"
        if keep is not None and change == "lora":
            shutil.copy(keep / name, out / name)
            continue
        tensors = {f"layers.{i}.weight": rng.bytes(per)}
        if i == 0:
            embed = (keep / "embed.bin").read_bytes() if keep and change == "frozen-embedding" else None
            tensors["embed_tokens.weight"] = embed or rng.bytes(args.embed_mb * MB)
            (out / "embed.bin").write_bytes(tensors["embed_tokens.weight"])
        _save(out / name, tensors)
    if keep is not None and change == "lora" and (keep / "embed.bin").exists():
        shutil.copy(keep / "embed.bin", out / "embed.bin")
    _save(out / "adapter_model.safetensors", {"lora_A": rng.bytes(args.adapter_mb * MB)})
    (out / "config.json").write_text(json.dumps({"model_type": "llama", "seed": seed}))
    return out


def export_view(src: Path, dest: Path) -> Path:
    """The export as published: without the bench's own copy of the embedding bytes."""
    dest.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.name != "embed.bin":
            os.link(p, dest / p.name)
    return dest


def child(argv: list[str]) -> None:
    """One publish in a process of its own: `who endpoint token repo export step`."""
    who, endpoint, token, repo, export, step = argv
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    from huggingface_hub import CommitOperationAdd, HfApi

    from stagerd.sinks.hub import HubSink

    t0 = time.perf_counter()
    if who == "stagerd":
        sink = HubSink.from_url(f"hf://{repo}", token=token, endpoint=endpoint)
        reported = sink.publish(Path(export), int(step)).bytes_uploaded
    else:
        files = sorted(p for p in Path(export).iterdir() if p.is_file())
        ops = [CommitOperationAdd(path_in_repo=p.name, path_or_fileobj=str(p)) for p in files]
        api = HfApi(endpoint=endpoint, token=token)
        api.create_repo(repo, private=True, exist_ok=True)
        api.create_commit(repo, ops, commit_message=f"step {step}")
        reported = -1
    print(json.dumps({"seconds": time.perf_counter() - t0, "reported": reported}))


def publish(hub, who: str, repo: str, export: Path, step: int, cache: Path) -> dict:
    env = {**os.environ, "HF_XET_CACHE": str(cache), "PYTHONPATH": str(REPO_ROOT)}
    env.pop("HF_HUB_DISABLE_XET", None)
    before = hub.stats.xet_bytes["xorb"] + hub.stats.xet_bytes["shard"]
    argv = [sys.executable, __file__, "--child", who, hub.endpoint, hub.token, repo, str(export), str(step)]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{who} publish failed:\n{out.stderr[-3000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    got["wire"] = hub.stats.xet_bytes["xorb"] + hub.stats.xet_bytes["shard"] - before
    return got


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-mb", type=int, default=256)
    p.add_argument("--embed-mb", type=int, default=32)
    p.add_argument("--adapter-mb", type=int, default=4)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    from tests.hubserver import HubConfig, HubServer

    work = Path(tempfile.mkdtemp(prefix="bench-hub-xet-"))
    results: dict[tuple[str, str, str], list[dict]] = {}
    try:
        step1 = make_export(work / "raw-1", args, seed=1, keep=None, change="")
        step2 = {c: make_export(work / f"raw-2-{c}", args, seed=2, keep=step1, change=c) for c in CHANGES}
        exports = {"1": export_view(step1, work / "export-1")}
        exports |= {c: export_view(d, work / f"export-2-{c}") for c, d in step2.items()}
        for r in range(args.rounds):
            order = WHO if r % 2 == 0 else WHO[::-1]
            for change in CHANGES:
                for pod in PODS:
                    # a server per pair of runs, so its xorbs go when the pair is done
                    with HubServer(work / "hub", config=HubConfig(xet_materialize=False)) as hub:
                        for who in order:
                            repo = f"bench/r{r}-{change}-{pod}-{who.replace('_', '-')}"
                            cache = work / f"cache-{repo.replace('/', '-')}"
                            publish(hub, who, repo, exports["1"], 1, cache)
                            cache2 = cache if pod == "warm" else work / f"cache2-{repo.replace('/', '-')}"
                            got = publish(hub, who, repo, exports[change], 2, cache2)
                            results.setdefault((change, pod, who), []).append(got)
                            shutil.rmtree(cache, ignore_errors=True)
                            shutil.rmtree(cache2, ignore_errors=True)
                            print(
                                f"round {r + 1} {change:17} {pod:5} {who:15} {got['wire'] / MB:8.1f} MiB"
                                f" {got['seconds']:6.2f} s",
                                file=sys.stderr,
                            )
                    shutil.rmtree(work / "hub", ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(args, results)


def report(args: argparse.Namespace, results: dict[tuple[str, str, str], list[dict]]) -> None:
    load = os.getloadavg()
    loads = " ".join(f"{x:.1f}" for x in load)
    print(
        f"\nModel {args.model_mb} MiB in {args.shards} shards (embedding {args.embed_mb} MiB), adapter "
        f"{args.adapter_mb} MiB; {args.rounds} rounds; load average {loads}, {os.cpu_count()} CPUs.\n"
    )
    print(
        "| step 2 after | pod | stagerd MiB sent | huggingface_hub MiB sent | stagerd s (min-max) | "
        "huggingface_hub s (min-max) | time ratio |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for change in CHANGES:
        for pod in PODS:
            ours, peer = results[(change, pod, "stagerd")], results[(change, pod, "huggingface_hub")]
            mib = [statistics.median(x["wire"] for x in runs) / MB for runs in (ours, peer)]
            secs = [sorted(x["seconds"] for x in runs) for runs in (ours, peer)]
            med = [statistics.median(s) for s in secs]
            print(
                f"| {change} | {pod} | {mib[0]:.1f} | {mib[1]:.1f} | {med[0]:.2f} ({secs[0][0]:.2f}-"
                f"{secs[0][-1]:.2f}) | {med[1]:.2f} ({secs[1][0]:.2f}-{secs[1][-1]:.2f}) | "
                f"{med[0] / med[1]:.2f}x |"
            )
    honest = all(
        x["reported"] >= x["wire"] for (_, _, who), runs in results.items() if who == "stagerd" for x in runs
    )
    print(f"\nstagerd's reported bytes cover the server's count in every run: {honest}")


if __name__ == "__main__":
    main()
