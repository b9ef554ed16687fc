"""The errors of a publish to a sink (or a prune of one): what failed there, and whether retrying helps."""

from __future__ import annotations

from stagerd.errors.base import StagerdError


class SinkError(StagerdError):
    """A publish that failed in a way retrying may fix (5xx, dropped connection, timeout)."""

    retryable = True
    hint = "the destination failed; stagerd retries with backoff, check its health and credentials"


class SinkAuthError(SinkError):
    """A bad token or a missing permission: retrying the request cannot help. The daemon's step is fine:
    its publish waits for the fix, checked again every `retry_max_seconds` and at each start."""

    retryable = False
    hint = "check the credentials of this destination and their permission there"


class SinkMissingError(SinkError):
    """The sink's destination itself does not exist (an S3 bucket): nothing was written. The step is fine,
    so it is never quarantined: a running daemon checks again every `retry_max_seconds`, and a `--once` run
    stops trying at once, leaving the step waiting for the next start."""

    retryable = True  # the destination may be created; until then the step waits
    hint = "create the bucket (e.g. `aws s3 mb s3://BUCKET`), or fix the sink URL"


class SinkDownError(SinkError):
    """A sink that a `--once` run found down: its tries failed `max_attempts` times in a row, whichever
    steps they were for, so the run tried none of its other steps. Nothing is wrong with those steps: the
    next start tries them again."""

    retryable = True  # a sink back up takes the steps: never quarantined for good
    hint = (
        "check that the sink is up and reachable from here (its endpoint, the network, the service's "
        "status page); the next `stagerd watch` tries these steps again by itself"
    )


class SinkConflictError(SinkError):
    """The destination already holds different content for this step."""

    retryable = False
    hint = "the destination holds a different upload for this step; inspect it before deleting anything"


class StepClaimedError(SinkError):
    """Another publisher, or a prune, holds the step's prefix on the sink: nothing of this publish was
    written there (what it created on free keys while finding that out is removed again)."""

    hint = (
        "two publishers write one step to one prefix (two jobs share it, or a job restarted elsewhere while "
        "the old one still publishes); stagerd retries and stops with a conflict if the other commits other "
        "files. A prune's claim is finished by the next `stagerd prune`; a publisher that is gone for good "
        "leaves its claim: delete that one object (named above), then retry"
    )


class ConditionsIgnoredError(SinkError):
    """An S3-compatible store that ignores a conditional request a change relies on to be exclusive
    (`If-None-Match` or `If-Match`): nothing was changed."""

    retryable = False
    hint = (
        "use a store that honours If-None-Match and If-Match on PUT and If-Match on DELETE (AWS S3 does); "
        "until then delete old steps by hand, manifest first, while nothing publishes to or prunes the sink"
    )


class IgnoredFilesError(SinkError):
    """A Hub repo whose `.gitignore`, on the branch a step is committed to, matches files of the step: the
    Hub marks them ignored and huggingface_hub leaves them out of the commit, which would lack them. Nothing
    was committed or tagged, and retrying cannot help until the rule goes."""

    retryable = False
    hint = (
        "remove the rule that matches from the repo's .gitignore on that branch, or publish to another repo "
        "or revision; then `stagerd retry ROOT --step N`"
    )
