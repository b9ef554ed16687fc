"""`Stager.load`: a committed step back into the trainer's sharded state dicts, as DCP loads, in place.

Every rank calls it with state dicts built for the same parallelism (FSDP2 / DTensor, or plain tensors).

1. The step: every rank lists the committed steps under its ROOT and the lists are gathered (one
   all_gather on the Stager's gloo group). Asked for a step, every rank must see it; asked for the newest,
   the newest step any rank sees must be seen by every rank. Otherwise every rank raises the same
   `LoadError` naming the ranks that cannot see it. No rank enters DCP's collectives alone, so this never
   hangs.
2. The step is checked on every rank (its marker, every listed file at its size, the headers of
   `model/` and `optim/`, an `optim/.metadata`; one node's marker of a node-locally staged step is not the
   whole model) and the outcome agreed on the same way: a damaged file is named, with the hint to restore
   the step or load another.
3. `model/` through DCP's `HuggingFaceStorageReader` (safetensors headers: nothing unpickled), and so
   are `optim/`'s tensors; its other leaves (lr, betas...) come from this rank's `.objects.pt` (rank 0's
   when the step had fewer ranks) through `torch.load(weights_only=True)`. A step whose `optim/` is in
   DCP's own format (an older stagerd) is read by `FileSystemReader` with an allowlist unpickler for its
   `.metadata` and torch's weights-only unpickler for its non-tensor values (`safe_metadata`).
   DCP reshards: a step saved with another world size or mesh loads (tested 2 -> 1 and 1 -> 2 ranks).
4. `extras/` are read back as bytes (`LoadedStep.extras`, `LoadedStep.json(name)`).

`optim_specs` lists the tensors a step's `optim/` holds (in either format), with their global dtype and
shape: what a caller that does not have the state dict at hand (a trainer integration) builds its load
templates from.

`load_export` reads a published HF export directory (`ROOT/step-N/export/`, or one `stagerd restore`
brought back) into a model state dict the same way, to start a fine-tune from it; an export holds no
optimizer state, and its tensors may have been cast (they are cast back to the state dict's dtypes).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from stagerd.contract import commit_marker, layout
from stagerd.contract.safetensors_format import read_header
from stagerd.errors import HeaderError, LoadError, MarkerError, ShardError, StagerdError
from stagerd.training.aliases import differing, split_aliases, untied_copies
from stagerd.training.collectives import Collectives
from stagerd.training.failures import describe
from stagerd.training.leaf_check import load_values
from stagerd.training.safe_metadata import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    check_torch_save,
    why_refused,
)
from stagerd.training.shard_files import objects_file
from stagerd.training.state_tree import set_objects, split_leaves, unplaced
from stagerd.training.step_choice import choose_step, ranks_text, rolled_back

log = logging.getLogger("stagerd.load")

MAX_EXTRA_BYTES = 256 << 20


@dataclass(frozen=True)
class LoadedStep:
    """What `Stager.load` loaded: the step, its directory, its marker and its extras (name -> bytes)."""

    step: int
    step_dir: Path
    marker: commit_marker.CommitMarker
    extras: Mapping[str, bytes] = field(default_factory=dict)
    seconds: float = 0.0

    def json(self, name: str) -> Any:
        """An extra saved as JSON (a dict or list passed to `save(extras=...)`), parsed."""
        if name not in self.extras:
            raise KeyError(f"step {self.step} has no extra {name!r} (has: {sorted(self.extras)})")
        return json.loads(self.extras[name])


def damaged_hint(step_dir: Path) -> str:
    """What to do about a committed step whose files are not what its marker and formats say."""
    step = layout.parse_step_dir(step_dir.name)
    n = "N" if step is None else str(step)
    return (
        f"the step's files are damaged: delete {step_dir} and restore it from a sink "
        f"(`stagerd restore URL ROOT --step {n}`), or load another step (load(..., step=M))"
    )


def agree(comm: Collectives, error: str | None, what: str, hint: str | None = None) -> None:
    """Every rank learns every rank's outcome; any failure is the same `LoadError` on every rank, with
    the first failing rank's `hint` (default LoadError's)."""
    outcomes = comm.all_gather(None if error is None else (error, hint))
    failed = [(r, e) for r, e in enumerate(outcomes) if e is not None]
    if failed:
        first = failed[0][1][0]
        same = all(e == first for _, (e, _) in failed)
        text = first if same else "; ".join(f"rank {r}: {e}" for r, (e, _) in failed)
        raise LoadError(
            f"{what} failed on {ranks_text([r for r, _ in failed])}: {text}", hint=failed[0][1][1]
        )


def _check_step(step_dir: Path, want_optim: bool) -> commit_marker.CommitMarker:
    marker = commit_marker.read_marker(step_dir)
    if marker.staging_nodes > 1:
        raise LoadError(
            f"holds only staging node {marker.staging_node} of {marker.staging_nodes}'s shards, "
            "not the whole model",
            path=step_dir,
            hint="publish the step raw and `stagerd restore` it whole onto every node, then load it",
        )
    commit_marker.check_staged_files(step_dir, marker)
    # A damaged header reaches DCP's reader as `AssertionError: metadata is None`, naming no file.
    for f in marker.files:
        if f.path.endswith(".safetensors") and f.path.startswith(
            (f"{layout.MODEL_DIR}/", f"{layout.OPTIM_DIR}/")
        ):
            read_header(step_dir / f.path)
    if (step_dir / layout.OPTIM_DIR / ".metadata").is_file():
        try:
            SafeFileSystemReader(str(step_dir / layout.OPTIM_DIR)).read_metadata()
        except LoadError as e:
            if e.hint == LoadError.hint:
                e.hint = damaged_hint(step_dir)
            raise
    has_optim = any(f.path.startswith(f"{layout.OPTIM_DIR}/") for f in marker.files)
    if want_optim and not has_optim:
        raise LoadError("has no optim/: it was saved without optimizer_state", path=step_dir)
    return marker


def _read_extras(step_dir: Path, marker: commit_marker.CommitMarker) -> dict[str, bytes]:
    prefix = f"{layout.EXTRAS_DIR}/"
    out = {}
    for f in marker.files:
        if f.path.startswith(prefix):
            if f.size > MAX_EXTRA_BYTES:
                continue  # a file extra (a tokenizer model, say): read it from step_dir if needed
            out[f.path[len(prefix) :]] = (step_dir / f.path).read_bytes()
    return out


def _dcp_load(comm: Collectives, state_dict: Any, reader: Any, what: str, planner: Any = None) -> None:
    """One `dcp.load`; DCP gathers every rank's failure itself, the check-in covers what it does not."""
    error = None
    try:
        dcp.load(
            state_dict,
            storage_reader=reader,
            planner=planner,
            process_group=comm.group,
            no_dist=comm.group is None,
        )
    except StagerdError as e:
        error = str(e)
    except (Exception, CheckpointException) as e:
        error = describe(e)
    agree(comm, error, what)


def optim_specs(step_dir: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Every tensor of the step's `optim/` (empty without one): key -> (dtype, global shape), from the
    safetensors headers (or, for DCP's own format, its `.metadata` through the allowlist). The
    optimizer's non-tensor leaves are not listed."""
    optim_dir = step_dir / layout.OPTIM_DIR
    if not optim_dir.is_dir():
        return {}
    if (optim_dir / ".metadata").is_file():
        reader: Any = SafeFileSystemReader(str(optim_dir))
    else:
        reader = HuggingFaceStorageReader(str(optim_dir))
    try:
        meta = reader.read_metadata()
    except StagerdError:
        raise
    except Exception as e:  # a truncated or garbled header: a clear error
        raise LoadError(f"optim/ is unreadable: {type(e).__name__}: {e}", path=optim_dir) from None
    return {
        k: (md.properties.dtype, tuple(md.size))
        for k, md in meta.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }


def _unplaced(optimizer_state: Mapping[str, Any], dropped: list[str], optim_dir: Path) -> LoadError:
    """The error for saved optimizer tensors `optimizer_state` has no place for. A step saved from
    `optimizer.state_dict()` keys its state by parameter index, `get_state_dict`'s by name: the usual hint
    (build it with `get_state_dict`) is then what the caller already did, so that case says what fits."""
    state = optimizer_state.get("state")
    by_name = isinstance(state, Mapping) and any(isinstance(k, str) and not k.isdigit() for k in state)
    by_index = any(name.split(".")[1].isdigit() for name in dropped if name.startswith("state."))
    if by_name and by_index:
        return LoadError(
            f"optim/ holds optimizer.state_dict()'s state, keyed by parameter index ({dropped[0]!r}, ...), "
            "and optimizer_state is keyed by parameter name, as get_state_dict(model, optimizer) gives it: "
            "after get_state_dict(model, optimizer) (which gives the optimizer its state), load into "
            "optimizer.state_dict() and pass that to optimizer.load_state_dict(); or save "
            "get_state_dict(model, optimizer)[1] to load by name",
            path=optim_dir,
        )
    return LoadError(
        f"optimizer_state has no place for {len(dropped)} tensors optim/ holds "
        f"({dropped[0]!r}, ...): the load would drop them; an optimizer that never stepped has "
        "no state yet: build the "
        "state dict with torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer), "
        "which creates it",
        path=optim_dir,
    )


def _load_optim(comm: Collectives, optim_dir: Path, optimizer_state: Mapping[str, Any]) -> None:
    """optim/ as the Stager writes it (safetensors blocks and each rank's other leaves), or in DCP's own
    format (a step saved by an earlier stagerd: its `.metadata` read through the allowlist)."""
    if (optim_dir / ".metadata").is_file():
        reader = SafeFileSystemReader(str(optim_dir))
        _dcp_load(comm, optimizer_state, reader, "loading optim/", SafeLoadPlanner())
        return
    tensors: dict[str, Any] = {}
    error = hint = None
    try:
        tensors, _ = split_leaves(optimizer_state, "optimizer_state")
        dropped = unplaced(optimizer_state, optim_specs(optim_dir.parent))
        if dropped:
            raise _unplaced(optimizer_state, dropped, optim_dir)
        mine = optim_dir.parent / objects_file(comm.rank)
        path = mine if mine.is_file() else optim_dir.parent / objects_file(0)
        with open(path, "rb") as f:
            try:  # a key nested a million deep crashes torch.load's unpickler: refused before it
                check_torch_save(f)
            except Exception as e:
                raise LoadError(
                    f"refusing the optimizer's leaves: {why_refused(e)}",
                    path=path,
                    hint=damaged_hint(optim_dir.parent),
                ) from None
            saved = load_values(f)
        if not isinstance(saved, dict):
            raise LoadError(f"holds a {type(saved).__name__}, not the optimizer's leaves", path=path)
        missing = set_objects(optimizer_state, saved)
        if missing:
            raise LoadError(f"optim/ has no {missing[0]!r} (nor {len(missing) - 1} more)", path=optim_dir)
    except StagerdError as e:
        error, hint = str(e), e.hint
    except Exception as e:
        error, hint = f"{optim_dir}: {type(e).__name__}: {e}", None
    agree(comm, error, "loading optim/", hint)
    _dcp_load(comm, tensors, HuggingFaceStorageReader(str(optim_dir)), "loading optim/")


def _check_untied(comm: Collectives, model_dir: Path, differ: list[tuple[str, str]]) -> None:
    """A step saved untied loads into a tied model only where its two tensors are the same: otherwise
    the tied model would silently keep the first key's and drop the other's."""
    error = None
    if differ:
        first, alias = differ[0]
        more = f" (and {len(differ) - 1} more pairs)" if len(differ) > 1 else ""
        error = (
            f"{model_dir}: the step holds {first!r} and {alias!r} as two different tensors{more}, and the "
            f"model ties them: loading would keep {first!r}'s values and drop {alias!r}'s"
        )
    agree(comm, error, "loading model/", _UNTIED_HINT)


_UNTIED_HINT = (
    "load into a model with those weights untied, as the step was saved, or tie them before saving; "
    "the model's state dict was filled with the step's other tensors"
)


def load_step(
    comm: Collectives,
    root: Path,
    state_dict: Mapping[str, Any],
    optimizer_state: Mapping[str, Any] | None,
    step: int | None,
    *,
    made: bool = False,
) -> LoadedStep:
    """Load a committed step under `root` into the state dicts, in place (see the module docstring).
    `made`: the Stager made `root`, so it did not exist before (said where no step is found)."""
    t0 = time.monotonic()
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        raise LoadError(f"step must be a non-negative integer or None, got {step!r}")
    mine = [s for s, _ in layout.committed_steps(root)]
    asks = comm.all_gather((step, optimizer_state is not None))
    if len(set(asks)) > 1:
        raise LoadError(f"ranks asked for different loads (step, optimizer_state given): {asks}")
    seen = comm.all_gather(mine)
    chosen = choose_step(seen, step, root, made=made)
    # the optimizer's state loaded too: training resumes there, and its later saves are skipped
    resumes = optimizer_state is not None
    if resumes and comm.rank == 0 and (later := rolled_back(seen, chosen)) is not None:
        log.warning("%s", later)
    step_dir = root / layout.step_dir_name(chosen)
    marker: commit_marker.CommitMarker | None = None
    error = hint = None
    try:
        marker = _check_step(step_dir, optimizer_state is not None)
    except (ShardError, HeaderError, MarkerError) as e:
        error, hint = str(e), damaged_hint(step_dir)
    except StagerdError as e:
        error, hint = str(e), e.hint
    except OSError as e:
        error = f"{step_dir}: {type(e).__name__}: {e}"
    agree(comm, error, f"checking step {chosen}", hint)
    assert marker is not None
    # A key whose tensor is another key's (tied weights) was staged once, under the first: loading into
    # that one fills both.
    given = dict(state_dict)
    model_sd, aliases = split_aliases(given)
    copies = untied_copies(given, aliases, marker.tensors)
    model_dir = step_dir / layout.MODEL_DIR
    _dcp_load(comm, {**model_sd, **copies}, HuggingFaceStorageReader(str(model_dir)), "loading model/")
    _check_untied(comm, model_dir, differing(model_sd, aliases, copies))
    if optimizer_state is not None:
        _load_optim(comm, step_dir / layout.OPTIM_DIR, optimizer_state)
    extras = _read_extras(step_dir, marker)
    took = time.monotonic() - t0
    log.info("loaded step %d from %s in %.2f s", chosen, step_dir, took, extra={"step": chosen})
    return LoadedStep(chosen, step_dir, marker, extras, took)


def load_export(comm: Collectives, directory: str | os.PathLike[str], state_dict: Mapping[str, Any]) -> None:
    """Load an HF export directory (safetensors files and their index) into a model state dict, in place."""
    directory = Path(directory)
    error = None
    if not (directory / layout.INDEX_NAME).is_file() and not any(directory.glob("*.safetensors")):
        error = f"{directory}: not an HF export (no {layout.INDEX_NAME}, no .safetensors)"
    agree(comm, error, "opening the export")
    # save_pretrained writes a tied weight once (not `lm_head.weight` beside `model.embed_tokens.weight`):
    # the tied model's other key is filled by the load into the one the export holds.
    try:
        held = set(HuggingFaceStorageReader(str(directory)).read_metadata().state_dict_metadata)
    except Exception:  # DCP's load below names what is wrong with the files
        held = set()
    given = dict(state_dict)
    model_sd, aliases = split_aliases(given)
    for alias in list(aliases):
        first = aliases.get(alias)
        if first is not None and first not in held and alias in held:  # the export kept the later key
            model_sd[alias] = model_sd.pop(first)
            aliases = {a: (alias if k == first else k) for a, k in aliases.items() if a != alias}
            aliases[first] = alias
    copies = untied_copies(given, aliases, held)
    what = f"loading export {directory}"
    _dcp_load(comm, {**model_sd, **copies}, HuggingFaceStorageReader(str(directory)), what)
    _check_untied(comm, directory, differing(model_sd, aliases, copies))
