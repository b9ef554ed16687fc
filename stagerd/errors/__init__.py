"""Named errors. Each carries the file it is about and a hint that tells the user what to do next.

`retryable` tells the daemon whether trying again later can help (a dead endpoint) or cannot (a corrupt
header): the journal quarantines a non-retryable failure at once instead of burning its attempts.

Every error is imported from here: their base is `errors/base.py`, the sinks' errors `errors/sinks.py`.
"""

from __future__ import annotations

import errno

from stagerd.errors.base import StagerdError as StagerdError
from stagerd.errors.base import one_line as one_line
from stagerd.errors.sinks import ConditionsIgnoredError as ConditionsIgnoredError
from stagerd.errors.sinks import IgnoredFilesError as IgnoredFilesError
from stagerd.errors.sinks import SinkAuthError as SinkAuthError
from stagerd.errors.sinks import SinkConflictError as SinkConflictError
from stagerd.errors.sinks import SinkDownError as SinkDownError
from stagerd.errors.sinks import SinkError as SinkError
from stagerd.errors.sinks import SinkMissingError as SinkMissingError
from stagerd.errors.sinks import StepClaimedError as StepClaimedError


class ResourceError(StagerdError):
    """The process, not its input, is short of something (open files, memory): the input is fine, and a
    later try may get what it needs."""

    retryable = True
    hint = (
        "stagerd ran out of open files or memory: raise its open-files limit (`ulimit -n`, LimitNOFILE= in "
        "a systemd unit) or free memory; the step is tried again"
    )


_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM})


def open_failed(e: OSError, path: object, error: type[StagerdError]) -> StagerdError:
    """`error` for an input that cannot be opened, or a `ResourceError` when the process is out of
    descriptors or memory: that says nothing of the file, which must not be quarantined as broken."""
    kind = ResourceError if e.errno in _EXHAUSTED else error
    return kind(f"cannot open: {e.strerror or e}", path=path)


class HeaderError(StagerdError):
    """A safetensors header that is malformed, hostile or inconsistent with its file."""

    hint = "the shard is corrupt or was not written by safetensors/DCP; re-save the step"


class ShardError(StagerdError):
    """A shard that is missing, truncated, or not the size its commit marker lists."""

    hint = "the staged step is incomplete; re-save it, or delete the step directory if it is abandoned"


class PlanError(StagerdError):
    """Shards that do not tile their tensors: gaps, overlaps, shape or dtype disagreement."""

    hint = "the shards do not form one consistent checkpoint; check that every rank's file is present"


class DTypeError(StagerdError):
    """An unknown dtype name, or a cast that is not allowed."""

    hint = "use --dtype bf16|fp16|fp32|keep; stagerd never guesses a dtype"


class ReferenceIndexError(StagerdError):
    """A reference index that cannot be read or names tensors absent from the shards."""

    hint = "pass the base model's model.safetensors.index.json, or drop --reference-index"


class MarkerError(StagerdError):
    """A commit marker that is malformed or points outside its step directory."""

    hint = "the marker was not written by stagerd.Stager; re-save the step"


class OutputError(StagerdError):
    """The output directory cannot be written (permissions, disk full, exists)."""

    retryable = True
    hint = "check that OUT is writable and its filesystem has free space"


class VerifyError(StagerdError):
    """An export whose files, index or values disagree."""

    hint = "re-run `stagerd consolidate`; never publish an export that fails verify"


class StepExistsError(StagerdError):
    """A step directory that is already committed."""

    hint = "use a new step number, or remove the old step directory first"


class LockError(StagerdError):
    """Another daemon owns this ROOT."""

    hint = "stop the other `stagerd watch` for this ROOT, or point this one at another ROOT"


class ConfigError(StagerdError):
    """A setting that is missing or invalid."""

    hint = "see `stagerd watch --help` and the configuration reference in README.md"


class StepBusyError(StagerdError):
    """A step directory that a `stagerd restore` or a Stager save of the same step is writing now."""

    retryable = True
    hint = "a restore and a save of one step never run together; wait for the other to finish, then retry"


class SymlinkError(StagerdError):
    """A symbolic link where stagerd would create, rename or delete: it could lead the write elsewhere."""

    hint = "point the command at the real directory, or replace the link by a directory; nothing was changed"


class JournalError(StagerdError):
    """The daemon journal is missing, unreadable, from a newer stagerd, or asked for an impossible move."""

    hint = "check ROOT/.stagerd/journal.sqlite; `stagerd watch ROOT` creates it on its first start"


class StateGoneError(JournalError):
    """The journal or the lock under ROOT/.stagerd was deleted or replaced while the daemon ran."""

    hint = (
        "something removed ROOT/.stagerd (or ROOT, or unmounted ROOT's filesystem) under a running daemon, "
        "which stopped so that two daemons never share a ROOT; remount ROOT if it was unmounted, then start "
        "`stagerd watch ROOT` again: it finds its journal there (or rebuilds it), and sinks skip what they "
        "already hold"
    )


class ExtrasError(StagerdError):
    """An extra file that the model's readers parse (config.json and the like) and could not."""

    hint = "fix the file in the trainer's extras and save the step again; nothing was published"


class ExportMismatchError(StagerdError):
    """A step exported with other options (dtype, kept names, shard size) than the ones asked now, while a
    sink already holds what the old options made."""

    hint = (
        "run the daemon with the options the step was exported with, then `stagerd retry ROOT --step N`; "
        "or remove the step from the sinks that hold it first"
    )


class StepConflictError(StagerdError):
    """A step saved again, with other data, after a save of the same step number reached a sink."""

    hint = (
        "to keep what was published, delete the new save's ROOT/step-N; to publish the new save instead, "
        "remove step N from each sink, then run `stagerd retry ROOT --step N`"
    )


class SaveError(StagerdError):
    """A training-side save whose background write failed (disk full, I/O error); the step is uncommitted."""

    retryable = True
    hint = (
        "the step was not committed and nothing will export it; free space on the staging root and save again"
    )


class SaveInputError(StagerdError):
    """Arguments to `Stager.save` that cannot be staged: a non-tensor value, a bad extras name or path."""

    hint = "pass a state dict of tensors, extras as {name: dict | bytes | path}, and a valid reference index"


class JournalFullError(JournalError):
    """The filesystem that holds the journal is full: a transition could not be recorded (nor was it)."""

    retryable = True
    hint = (
        "free space (or inodes) on the filesystem that holds ROOT/.stagerd; nothing was lost: the step keeps "
        "its last recorded state and the daemon resumes from it"
    )


class LoadError(StagerdError):
    """A step that cannot be loaded into training: absent, seen by only some ranks, incomplete, or refused."""

    hint = (
        "check that every rank sees the same committed step under ROOT (restore it with `stagerd restore` "
        "onto every node), and that the state dicts match the model that saved it"
    )


class RestoreError(StagerdError):
    """A remote step that cannot be restored as it is: a missing or corrupt object, a bad manifest."""

    hint = "nothing was landed in ROOT; check the step on the sink, or restore another step with --step N"


class StepVanishedError(RestoreError):
    """The step was deleted from the sink (a prune) while it was restored, or is being deleted: nothing was
    landed. A prune leaves a step alone while a restore's lease on it is live, so this is a prune that had
    decided before the lease was written, one of an older stagerd, or another tool."""

    retryable = True
    hint = (
        "nothing was landed; a prune deleted the step (keep more steps, or restore another): run the restore "
        "again, without --step it takes the newest step"
    )


class HubPlanError(StagerdError):
    """A to-Hub plan (the conversion of the trainer's names and layout to the checkpoint's) that cannot be
    carried out as byte moves: an op that is not a permutation of elements, two tensors given one name, a
    strict mapping leaving keys unmapped, a split whose sizes do not add up."""

    hint = (
        "the export would not be what save_pretrained writes; fix the mapping, or save without model= / "
        "mapping= to export the trainer's own names"
    )


class ModelConfigError(HubPlanError):
    """An adopted checkpoint whose names become the Hub's only with the model's config.json (torchtitan's
    RoPE rows need its head counts), where no config.json was found or it lacks what the plan needs. Its
    own class, so the hint a `--once` summary and `stagerd status` give from the class is the one for it,
    not the Stager's `model=` / `mapping=` advice."""

    hint = (
        "put the model's config.json (the run's HF assets) in the checkpoint's directory or the one above it "
        "(ROOT), or pass --extras DIR holding it; the trainer's files were not touched"
    )


class ModelShapeError(ModelConfigError):
    """An adopted checkpoint whose config.json describes another model than the one it holds: a tensor of
    another shape than that model's, or RoPE rows permuted in heads other than the ones it rotates.
    `from_pretrained` of such an export builds config.json's model, which cannot hold the weights."""

    hint = (
        "pass the run's own config.json (the one it trained with) with --extras DIR, or put it beside the "
        "checkpoint; nothing was published, the trainer's files were not touched"
    )


class FleetWaitError(StagerdError):
    """A node-locally staged step whose other nodes did not all arrive (or finish) within the wait."""

    retryable = True
    hint = (
        "start the daemon of every node named as missing; the step waits for them and is never published "
        "partially"
    )


class FleetVersionError(FleetWaitError):
    """The nodes of a fleet step run stagerd builds that speak different fleet protocols (the format of what
    they write on the exchange), as during a rolling upgrade: they could never finish the step together.
    The step waits for one build on every node as for a node that never comes: retried, never quarantined."""

    hint = (
        "run the same stagerd version on every node: upgrade the node named as running the older build and "
        "restart its daemon (the rolling upgrade finished); the step waits for it, is never published "
        "partially, and is retried by itself"
    )


class FleetNodeConflictError(StagerdError):
    """Two daemons (two ROOTs) claimed the same staging node id for one step on the exchange."""

    hint = "give each node its own STAGERD_NODE_ID (0..N-1); one daemon per node and ROOT"


class DcpFormatError(StagerdError):
    """A torch DCP checkpoint stagerd cannot read without torch: a `.metadata` that is corrupt or pickles a
    class outside the allowlist, or tensor data not stored as plain bytes at a recorded offset."""

    hint = (
        "the checkpoint is corrupt, was not written by torch.distributed.checkpoint's FileSystemWriter, or "
        "uses a storage option stagerd does not read (compression, safetensors serialization); nothing was "
        "exported or published"
    )


class AdoptError(StagerdError):
    """A trainer's checkpoint that cannot be adopted as it is: no preset recognises it, two directories give
    one step number, or its selection leaves no model tensor."""

    hint = (
        "name the preset with --adopt PRESET, choose the model's tensors with --adopt-select REGEX, or give "
        "each checkpoint its own step number; the trainer's files were not touched"
    )


class SourceChangedError(StagerdError):
    """An adopted checkpoint whose files changed or disappeared while it was exported."""

    retryable = True
    hint = (
        "the trainer rewrote or deleted the checkpoint during its export; nothing was published. stagerd "
        "tries again if it is still there and finished"
    )


class SourceGoneError(StagerdError):
    """ROOT is no longer the directory the daemon started on (its filesystem unmounted, or ROOT replaced),
    so its checkpoints look deleted: none is taken for lost while so."""

    retryable = True
    hint = (
        "is ROOT's filesystem mounted? Mount it again (or put ROOT back) and start `stagerd watch` again: "
        "the steps still waiting are exported then"
    )
