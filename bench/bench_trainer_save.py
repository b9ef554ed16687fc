"""Training-loop time lost per save in the Hugging Face Trainer: its own `save_steps` save against
`StagerdCallback`, same model, same data, same interval.

    python bench/bench_trainer_save.py --rounds 5 --steps 14 --every 4

One process, CPU. Each round trains a fresh Llama (same seed, same batches) three times, in a rotating
order: `none` (save_strategy="no"), `trainer` (the Trainer's own checkpoint: save_pretrained, optimizer.pt,
scheduler, RNG, trainer_state.json) and `stagerd` (the callback: the same state as one async Stager save).
The loop is timed from `train()`'s start to the end of its last step; saves fall at every `--every` steps
and the last one before the last step (14 steps, every 4: saves at 4, 8, 12), as in a long run. Per save:

- lost: (loop time - the round's `none` loop time) / saves. Everything the saves cost the loop: the
  stall, the wait for the copy before the next optimizer step, and the slowdown of the next steps while a
  save writes in the background (on a CPU-only machine the write shares the cores with training).
- standstill: the time the loop stands still for a save: from the end of the step to the next step's start
  (the Trainer saves in between), plus, for stagerd, the wait for the copy in the next optimizer step.

After the loop, `train()` returns once every save is committed: for stagerd, the rest of the last save's
write and fsync (`end wait`, once per training, not per save). The headline is the median of the
per-round ratios stagerd / trainer; medians and min-max over rounds beside it. Prints a markdown table
with the load average.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = ("none", "trainer", "stagerd")


def _model(args: argparse.Namespace) -> Any:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=2,
        max_position_embeddings=args.seq, tie_word_embeddings=False,
    )  # fmt: skip
    return tf.AutoModelForCausalLM.from_config(config)


def _dataset(args: argparse.Namespace) -> Any:
    import torch
    from datasets import Dataset

    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, args.vocab, (args.steps * args.batch, args.seq), generator=g).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def _clock_base() -> Any:
    from transformers import TrainerCallback

    return TrainerCallback


class _Clock(_clock_base()):  # type: ignore[misc]
    """The loop's standstill per save: step end -> next step begin around a save step, plus stagerd's wait
    for the copy (`_timed_wait`); and when the last step ended."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.stall = 0.0
        self.last_step_end = 0.0
        self._end: float | None = None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.last_step_end = time.perf_counter()
        self._end = self.last_step_end if state.global_step % self.every == 0 else None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._end is not None:
            self.stall += time.perf_counter() - self._end
            self._end = None

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.on_step_begin(args, state, control)  # a save at the last step


def _timed_wait(cb: Any, clock: _Clock) -> None:
    """Time stagerd's wait for the copy: `wait_staged`, which the optimizer the callback attached the
    Stager to calls before it updates anything."""
    make = cb._stager

    def stager() -> Any:
        s = make()
        if "wait_staged" not in vars(s):
            inner = s.wait_staged

            def wait_staged(timeout: float | None = None) -> None:
                t0 = time.perf_counter()
                try:
                    inner(timeout)
                finally:
                    clock.stall += time.perf_counter() - t0

            s.wait_staged = wait_staged
        return s

    cb._stager = stager


def run_once(variant: str, args: argparse.Namespace, scratch: Path) -> tuple[float, float, float]:
    """(loop time, standstill, end wait) of one training."""
    import transformers as tf

    from stagerd.integrations.transformers import StagerdCallback

    out = scratch / variant
    clock = _Clock(args.every)
    training = tf.TrainingArguments(
        output_dir=str(out / "output"), max_steps=args.steps, save_steps=args.every,
        save_strategy="no" if variant == "none" else "steps", logging_strategy="no",
        save_total_limit=1 if variant == "trainer" else None,
        per_device_train_batch_size=args.batch, use_cpu=True, report_to=[], disable_tqdm=True, seed=7,
    )  # fmt: skip
    trainer = tf.Trainer(model=_model(args), args=training, train_dataset=_dataset(args), callbacks=[clock])
    trainer.remove_callback(tf.trainer_callback.PrinterCallback)
    if variant == "stagerd":
        cb = StagerdCallback(root=out / "root")
        _timed_wait(cb, clock)
        trainer.add_callback(cb)
    t0 = time.perf_counter()
    trainer.train()  # stagerd: returns with every save committed (on_train_end)
    t1 = time.perf_counter()
    shutil.rmtree(out, ignore_errors=True)
    return clock.last_step_end - t0, clock.stall, t1 - clock.last_step_end


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--every", type=int, default=4, help="save_steps")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temp dir)")
    args = p.parse_args()

    import torch
    import transformers as tf

    tf.logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    saves = (args.steps - 1) // args.every  # none at the last step: the loop window ends there
    scratch = Path(tempfile.mkdtemp(prefix="stagerd-bench-trainer-", dir=args.dir))
    params = sum(p.numel() for p in _model(args).parameters())
    print(f"# {params / 1e6:.1f} M params fp32 ({params * 4 / 1e6:.0f} MB; with AdamW's state about "
          f"{params * 12 / 1e6:.0f} MB per save), {args.steps} steps, a save every {args.every} "
          f"({saves} saves), {args.rounds} rounds, torch threads {torch.get_num_threads()}",
          flush=True)  # fmt: skip
    rows: dict[str, list[tuple[float, float, float]]] = {v: [] for v in VARIANTS}
    try:
        run_once("none", args, scratch)  # warm-up: imports, allocator, page cache
        for r in range(args.rounds):
            order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]
            for v in order:
                rows[v].append(run_once(v, args, scratch))
            none = rows["none"][-1][0]
            got = {v: (rows[v][-1][0] - none) / saves for v in ("trainer", "stagerd")}
            stalls = {v: rows[v][-1][1] / saves for v in ("trainer", "stagerd")}
            print(f"round {r + 1}: none {none:.2f} s; per save: lost trainer {got['trainer']:.3f} s, "
                  f"stagerd {got['stagerd']:.3f} s; standstill trainer {stalls['trainer']:.3f} s, "
                  f"stagerd {stalls['stagerd']:.3f} s; end wait stagerd {rows['stagerd'][-1][2]:.3f} s",
                  flush=True)  # fmt: skip
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report(rows, saves)


def report(rows: dict[str, list[tuple[float, float, float]]], saves: int) -> None:
    both = ("trainer", "stagerd")
    none = [t for t, _, _ in rows["none"]]
    lost = {v: [(t - n) / saves for (t, _, _), n in zip(rows[v], none, strict=True)] for v in both}
    stall = {v: [s / saves for _, s, _ in rows[v]] for v in both}
    end = {v: [e for _, _, e in rows[v]] for v in both}

    def ratio(d: dict[str, list[float]]) -> list[float]:
        return [s / t for s, t in zip(d["stagerd"], d["trainer"], strict=True) if t > 0]

    def cell(xs: list[float]) -> str:
        return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"

    load = os.getloadavg()
    print(f"\nload average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {len(none)} paired rounds\n")
    print("| per save | Trainer's own save (s) | StagerdCallback (s) | stagerd / Trainer, paired (min-max) |")
    print("|---|---|---|---|")
    print(f"| loop time lost | {cell(lost['trainer'])} | {cell(lost['stagerd'])} | **{cell(ratio(lost))}** |")
    print(f"| loop standstill | {cell(stall['trainer'])} | {cell(stall['stagerd'])} | {cell(ratio(stall))} |")
    print(f"\nloop without saves: {cell(none)} s; end of training wait (once): "
          f"trainer {cell(end['trainer'])} s, stagerd {cell(end['stagerd'])} s")  # fmt: skip


if __name__ == "__main__":
    main()
