"""The Hugging Face Trainer (and TRL's trainers) saving through the `Stager`: one callback.

    from stagerd.integrations.transformers import StagerdCallback

    stagerd = StagerdCallback(root="/local_nvme/ckpt", dtype="bf16")
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[stagerd])
    trainer.train(resume_from_checkpoint=stagerd.resume(trainer))  # None on a fresh run

The Trainer still decides when to save (`save_strategy`, `save_steps`) and runs its own
`_save_checkpoint` (logging, evaluation and `trainer_state.json` first, as always), but the callback takes
over its writes: the model, optimizer, LR scheduler, grad scaler and RNG saves become one async
`Stager.save` of step `global_step` (`hf_trainer`), so the loop blocks only for the copy, and the copy
itself is waited for right before the next optimizer step updates anything (`Stager.attach` on the
Trainer's innermost torch optimizer, at the start of training), hidden under the next forward and
backward; with an optimizer that has train and eval modes (schedule-free), whose switch back before the
next forward writes the parameters, the save waits for its copy. The export is Hub-faithful (`model=` is
the Trainer's model); `config.json`, `generation_config.json` and the tokenizer's files go in as extras
(`hf_files`).

What keeps its meaning, and what maps to the daemon:
- `save_strategy`, `save_steps`, `save_only_model` (then the model alone is saved), `save_strategy="best"`:
  as in the Trainer; the step is `global_step`.
- `save_total_limit`: nothing is written under `output_dir`, so there is nothing to rotate; staged steps
  are the daemon's: `stagerd watch ROOT --keep-last N` (and `--remote-keep-last` on a sink). It is unset
  while the training runs: with 1 and a best checkpoint, the Trainer would delete at the end every other
  `checkpoint-*` folder under `output_dir`, none of them this run's.
- `load_best_model_at_end` (with `metric_for_best_model`): the Trainer tracks the best metric as always;
  `state.best_model_checkpoint` names the best step's directory, ROOT/step-N (in `trainer_state.json`
  too), and at the end of training the model's weights are loaded from that staged step, on every rank,
  once every save is committed. Every rank pins the best step (`contract/step/pin.py`) until a better one
  is named or the training ends, so the daemon's `--keep-last` keeps it; after the end, the daemon keeps
  the best the newest step's `trainer_state.json` names. A best step gone is a `LoadError` at the end,
  never the last weights kept in silence.
- `push_to_hub` (per save): the daemon publishes every committed step: `--sink hf://ORG/NAME`. The
  Trainer's own per-save push is skipped; `trainer.push_to_hub()` called by the user is untouched.
- DeepSpeed is refused at the start of training (a `ConfigError`).

Resuming: `resume(trainer)` picks the newest step committed under ROOT that every rank sees (or `step=`),
e.g. one `stagerd restore` brought back, and returns its `extras/` folder, where the Trainer finds
`trainer_state.json` (global step, epoch, which batches to skip). `train(resume_from_checkpoint=...)` also
takes True or ROOT (the newest step; True with none: the Trainer's own checkpoints) and a step directory
ROOT/step-N. The callback then loads the model, optimizer, scheduler, scaler and RNG states where the
Trainer would load its own files.

Callback events do not receive the Trainer, and the save must run inside the Trainer's
`_save_checkpoint`; so the callback binds itself to the Trainer (`trainer_bind`): the one that fires its
first event, the one `add_callback` adds it to, or the one `resume()` is given, and wraps a few of its
methods on the instance until `remove_callback` or `pop_callback` takes it out.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
from transformers import Trainer, TrainerCallback

from stagerd.contract import layout
from stagerd.errors import ConfigError, LoadError, SaveError, SaveInputError, StepExistsError
from stagerd.integrations import best_step, hf_files, hf_trainer, rng, trainer_bind, trainer_writes
from stagerd.training.config_model import uncompiled
from stagerd.training.stager import Stager
from stagerd.training.step_choice import choose_step, holds

log = logging.getLogger("stagerd.integrations")

_LIVE: weakref.WeakSet[StagerdCallback] = weakref.WeakSet()  # each with a Stager, in this process
_OURS = ("model", "optimizer_state", "step")  # the callback's to give, from the Trainer
_SAVE_WRITERS = ("_save_optimizer_and_scheduler", "_save_scaler", "_save_rng_state", "_push_from_checkpoint")
_LOADERS = ("_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_scaler", "_load_rng_state")
_WRAPPED = ("train", "_save_checkpoint", "save_model", "_get_output_dir", "_load_best_model", *_SAVE_WRITERS)


class StagerdCallback(TrainerCallback):
    """Takes over a Trainer's checkpoint saves (see the module docstring). `save_options`: more keyword
    arguments of `Stager.save` (`dtype`, `extras`, `metadata`, `reference_index`, `mapping`);
    `stager_options`: of `Stager(...)` (`timeout`, `checkpointer`, `pin_memory`)."""

    def __init__(
        self,
        root: str | Path | None = None,
        *,
        stager_options: Mapping[str, Any] | None = None,
        **save_options: Any,
    ):
        if root is None:  # `add_callback(StagerdCallback)`: transformers makes one with no arguments
            raise ConfigError("StagerdCallback needs root=, the directory its steps are saved under",
                              hint="give an instance: trainer.add_callback(StagerdCallback(root=ROOT)) or "
                              "callbacks=[StagerdCallback(root=ROOT)]")  # fmt: skip
        bad = [k for k in _OURS if k in save_options]
        if bad:
            raise SaveInputError(f"StagerdCallback gives {bad} itself, from the Trainer; do not pass them")
        self.root = Path(root)
        self.save_options = save_options
        self.stager_options = dict(stager_options or {})
        self.stager: Stager | None = None
        self._trainer: Trainer | None = None
        self._replaced: trainer_bind.Replaced | None = None
        self._restored: hf_trainer.Restored | None = None
        self._resumed_step: int | None = None  # the step this train() resumed from, until on_train_begin
        self._model_files: dict[str, bytes] | None = None  # config and tokenizer: made once per training
        self._said: set[str] = set()
        self._limit: int | None = None  # the user's save_total_limit, unset while training
        self._best = best_step.BestStep(self.root)  # pinned against the daemon's retention

    # -- the documented call -----------------------------------------------------------------------

    def resume(self, trainer: Trainer, step: int | None = None) -> str | None:
        """The checkpoint to pass to `trainer.train(resume_from_checkpoint=...)`: the newest step committed
        under ROOT that every rank sees (or `step`), None when there is none. Collective: every rank."""
        return self._resume(trainer, step, required=False)

    def _resume(self, trainer: Trainer, step: int | None, *, required: bool) -> str | None:
        """`resume()`; `required`: no committed step is a `LoadError` naming ROOT, not None."""
        self._bind(trainer)
        self._settle()
        seen = self._committed_on_every_rank()
        if step is None and not any(seen) and not required:
            log.info("no committed step under %s (%s): a fresh run", self.root, holds(self.root))
            return None
        chosen = choose_step(seen, step, self.root)
        return str(self.root / layout.step_dir_name(chosen) / layout.EXTRAS_DIR)

    def _settle(self) -> None:
        """The saves under ROOT of this process's callbacks (this one's, or one a new Trainer replaced)
        committed (or failed) before the steps are listed: a training stopped by an exception (Ctrl-C in a
        notebook) and resumed in the same process leaves its newest save still being written."""
        root = self.root.resolve()
        for stager in [s for cb in _LIVE if (s := cb.stager) is not None and cb.root.resolve() == root]:
            try:
                stager.wait()
            except SaveError as e:  # raised on every rank alike; its step is not committed, older ones are
                self._say(f"a save of this run failed, so it is not resumed from: {e.message}")

    def _committed_on_every_rank(self) -> list[list[int]]:
        """Each rank's committed steps under ROOT (collective)."""
        mine = [s for s, _ in layout.committed_steps(self.root)]
        seen = [mine]
        if dist.is_available() and dist.is_initialized():
            seen = [[] for _ in range(dist.get_world_size())]
            dist.all_gather_object(seen, mine)
        return seen

    # -- callback events ---------------------------------------------------------------------------

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._bind_caller()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._bind_caller()
        trainer = self._bound()
        self._model_files = None
        self._best.skipped.clear()
        if getattr(trainer, "is_deepspeed_enabled", False):
            raise ConfigError("StagerdCallback does not save DeepSpeed engines", hint="use FSDP2 or DDP")
        resumed, self._resumed_step = self._resumed_step, None
        if args.load_best_model_at_end and resumed is not None:
            self._best.of_resumed(trainer, resumed)
        # no warning for load_best_model_at_end: every rank pins the best step (`best_step`), which the
        # daemon's --keep-last keeps; the gap between a training and its resume is in the LoadError's hint
        if args.save_total_limit and not args.load_best_model_at_end:
            self._say(f"save_total_limit={args.save_total_limit} has no effect: nothing is written under "
                      f"output_dir; the daemon keeps the newest steps: stagerd watch --keep-last "
                      f"{args.save_total_limit}")  # fmt: skip
        if args.save_total_limit is not None:  # else still unset by a train() that raised: kept
            self._limit, args.save_total_limit = args.save_total_limit, None
        self._attach(trainer)  # before the first step: its buffers are reserved after it

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._limit is not None:
            args.save_total_limit, self._limit = self._limit, None
        self._best.release()
        stager, self.stager = self.stager, None
        if stager is not None:
            stager.close()  # every save committed, or its SaveError raised here

    # -- binding to the Trainer --------------------------------------------------------------------

    def _bind_caller(self) -> None:
        trainer = None if self._trainer is not None else trainer_bind.caller()
        if trainer is not None:
            self._bind(trainer)

    def _added_to(self, trainer: Trainer) -> None:
        self._bind(trainer)  # before train() reads its resume_from_checkpoint: no event comes earlier

    def _removed_from(self, trainer: Trainer) -> None:
        """The Trainer's own methods back, and whatever a training left open closed."""
        if self._trainer is not trainer:
            return
        if self._replaced is not None:
            self._replaced.undo()
        self._trainer, self._replaced = None, None
        self.on_train_end(trainer.args, trainer.state, trainer.control)

    def _bind(self, trainer: Trainer) -> None:
        if self._trainer is trainer:
            return
        if self._trainer is not None:
            raise ConfigError("a StagerdCallback serves one Trainer; give each Trainer its own")
        others = trainer.callback_handler.callbacks
        if any(isinstance(cb, StagerdCallback) and cb._trainer is trainer for cb in others):
            # two would each take the save over, one inside the other: two saves of one step
            raise ConfigError("this Trainer already has a StagerdCallback; give it one",
                              hint="pass every Stager.save option to that one callback")  # fmt: skip
        missing = [n for n in (*_WRAPPED, *_LOADERS) if not callable(getattr(trainer, n, None))]
        if missing:
            raise ConfigError(f"this Trainer has no {missing}: a transformers version stagerd does not know")
        self._trainer = trainer
        train = trainer.train
        save = trainer._save_checkpoint  # the class's, a subclass's override included
        load_best = trainer._load_best_model
        replacements: dict[str, Any] = {
            "train": lambda *a, **kw: self._train(train, *a, **kw),
            "_save_checkpoint": lambda model, trial: self._save_checkpoint(save, model, trial),
            "_load_best_model": lambda: self._load_best_model(load_best),
        }
        replacements.update({n: self._loader(n, getattr(trainer, n)) for n in _LOADERS})
        self._replaced = trainer_bind.Replaced(trainer, replacements)

    def _train(self, train: Any, *args: Any, **kwargs: Any) -> Any:
        """`Trainer.train`, its `resume_from_checkpoint` read as this callback's (`_checkpoint`)."""
        if args:
            args = (self._checkpoint(args[0]), *args[1:])
        elif "resume_from_checkpoint" in kwargs:
            kwargs["resume_from_checkpoint"] = self._checkpoint(kwargs["resume_from_checkpoint"])
        return train(*args, **kwargs)

    def _checkpoint(self, given: Any) -> Any:
        """`True` (the newest checkpoint), ROOT (its newest step) and a step directory ROOT/step-N (as
        `best_model_checkpoint` names it, or `stagerd restore` lands it) mean that committed step, as
        `resume()` gives it: the Trainer alone would look for `checkpoint-*` under output_dir, where
        nothing is written, or for its own files in the step directory, and raise. Without a committed
        step, True goes on to the Trainer: its own checkpoints, or its error; ROOT is a `LoadError` naming
        it and what it holds (the Trainer's own error would say nothing of stagerd). Anything else is
        the Trainer's."""
        if given is True:
            return self.resume(self._bound()) or True
        if not isinstance(given, str | os.PathLike):
            return given
        path, root = Path(given).resolve(), self.root.resolve()
        if path == root:
            return self._resume(self._bound(), None, required=True)
        step = layout.parse_step_dir(path.name)
        if step is not None and path.parent == root:
            return self.resume(self._bound(), step=step)
        return given

    def _bound(self) -> Trainer:
        if self._trainer is None:
            raise ConfigError("StagerdCallback is not attached to a Trainer",
                              hint="pass it in callbacks=[...] or trainer.add_callback(...)")  # fmt: skip
        return self._trainer

    def _stager(self) -> Stager:
        if self.stager is None:
            self.stager = Stager(self.root, **self.stager_options)
            _LIVE.add(self)
        return self.stager

    def _attach(self, trainer: Trainer) -> Stager:
        """The Stager, attached to the optimizer the Trainer steps (inside Accelerate's wrapper): its step
        waits for a save's copy, after the forward and backward it hid under (once per optimizer)."""
        stager = self._stager()
        if getattr(trainer, "optimizer", None) is not None:
            stager.attach(hf_trainer.torch_optimizer(trainer.optimizer))
        return stager

    # -- saving ------------------------------------------------------------------------------------

    def _save_checkpoint(self, save: Any, model: Any, trial: Any) -> None:
        """The Trainer's own `_save_checkpoint`, its writes taken over, then one async Stager save."""
        trainer = self._bound()
        captured = hf_trainer.Captured()
        scratch = Path(tempfile.mkdtemp(prefix="stagerd-trainer-"))
        try:
            with trainer_writes.captured(trainer, captured, scratch):
                save(model, trial)
            self._best.named_in(trainer, scratch)
            # trainer_state.json and a subclass's files: on the ranks that save (args.should_save)
            folder = scratch / f"checkpoint-{trainer.state.global_step}"
            files = {
                str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
            }
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        if captured.pushed:
            self._say("push_to_hub: the Trainer's per-save push is skipped; the daemon publishes every "
                      "committed step: stagerd watch ROOT --sink hf://ORG/NAME")  # fmt: skip
        self._start_save(trainer, captured, files)

    def _start_save(self, trainer: Trainer, captured: hf_trainer.Captured, files: dict[str, bytes]) -> None:
        stager = self._attach(trainer)
        msd, optim = hf_trainer.state_to_save(trainer, captured, stager.rank)
        options = dict(self.save_options)
        exported = uncompiled(trainer.model)  # a model the user compiled: the one inside, as saved
        extras: dict[str, Any] = {}
        if stager.rank == 0:
            if self._model_files is None:
                tokenizer = hf_files.tokenizer_files(getattr(trainer, "processing_class", None))
                self._model_files = {**hf_files.model_files(exported), **tokenizer}
            extras.update(self._model_files)
            extras.update(files)
            extras.update(options.pop("extras", None) or {})
        options.pop("extras", None)
        if "mapping" not in options:
            options["model"] = exported
        try:
            stager.save(msd, step=trainer.state.global_step, extras=extras, optimizer_state=optim, **options)
        except StepExistsError:  # raised on every rank alike: a resumed run reaching a step it had saved
            self._best.skipped.add(trainer.state.global_step)
            self._say(
                f"step {trainer.state.global_step} is already committed under {self.root}; not saved again"
            )
            return
        if hf_trainer.writes_before_its_step(trainer.optimizer):
            stager.wait_staged()

    # -- loading -----------------------------------------------------------------------------------

    def _ours(self, checkpoint: Any) -> int | None:
        """The step of a `resume()` path (ROOT/step-N/extras), or None for the Trainer's own checkpoints."""
        if checkpoint is None:
            return None
        path = Path(checkpoint)
        step = layout.parse_step_dir(path.parent.name) if path.name == layout.EXTRAS_DIR else None
        if step is None or path.parent.parent.resolve() != self.root.resolve():
            return None
        return step

    def _loader(self, name: str, original: Any) -> Any:
        def load(checkpoint: Any, *args: Any, **kwargs: Any) -> None:
            step = self._ours(checkpoint)
            if step is None:
                return original(checkpoint, *args, **kwargs)
            trainer = self._bound()
            if name == "_load_optimizer_and_scheduler":  # the model is prepared and the optimizer made
                self._restored = hf_trainer.load(trainer, self._stager(), step)
                self._resumed_step = step
                log.info("resumed from step %d under %s", step, self.root)
                return original(checkpoint, *args, **kwargs)  # a subclass's own files, in extras/
            if name == "_load_scaler" and self._restored is not None:
                hf_trainer.restore_scaler(trainer, self._restored.scaler)
            if name == "_load_rng_state" and self._restored is not None:
                self._restore_rng()
            return None  # `_load_from_checkpoint`: the model loads with the optimizer, above

        return load

    def _load_best_model(self, original: Any) -> None:
        """At the end of training: the best step's model weights, from ROOT (the Trainer's own loader for
        a checkpoint of its own, e.g. named by the state of a run resumed from one). Collective."""
        trainer = self._bound()
        best = Path(str(trainer.state.best_model_checkpoint))  # the Trainer calls it only when set
        step = layout.parse_step_dir(best.name)
        if step is None or best.parent.resolve() != self.root.resolve():
            return original()
        stager = self._stager()
        stager.wait()  # the best step may be the newest save, still being written: committed first
        problem = self._best.unloadable(step, self._committed_on_every_rank)
        if problem is not None:
            self.on_train_end(trainer.args, trainer.state, trainer.control)  # the Trainer will not call it
            metric = f"{trainer.args.metric_for_best_model}={trainer.state.best_metric}"
            why, hint = problem
            raise LoadError(f"cannot load the best model ({metric}): {why}; the model keeps the last weights",
                            path=best, hint=hint)  # fmt: skip
        hf_trainer.load_model(trainer, stager, step)
        log.info("loaded the best model (step %d, %s=%s) from %s", step,
                 trainer.args.metric_for_best_model, trainer.state.best_metric, best)  # fmt: skip

    def _restore_rng(self) -> None:
        assert self._restored is not None
        rank = self._stager().rank
        if not self._restored.rng:  # saved by fewer ranks, or with save_only_model
            log.warning("the step holds no RNG state for rank %d: the resumed run draws other numbers", rank)
            return
        rng.restore(rank, self._restored.rng)

    def _say(self, message: str) -> None:
        """A warning, once, from rank 0 (every rank would say the same)."""
        distributed = dist.is_available() and dist.is_initialized()
        if message not in self._said and (not distributed or dist.get_rank() == 0):
            self._said.add(message)
            log.warning("%s", message)


trainer_bind.install()
