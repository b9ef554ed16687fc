"""Daemon settings: a TOML file < `STAGERD_*` environment < command-line flags, by pydantic-settings
(read from those by `daemon/settings_sources.py`).

Every field carries its description: `settings_table()` renders them for the README and `--help`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal, TypedDict

from pydantic import ByteSize, Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from stagerd.contract.key_mapping import KeyMapping
from stagerd.contract.sharding import DEFAULT_MAX_SHARD_SIZE, FLEET_MAX_SHARD_SIZE
from stagerd.errors import StagerdError

ENV_PREFIX = "STAGERD_"
# Bounds that catch a mistyped number before it becomes 10^20 threads or a timer past time_t.
MAX_WORKERS = 256
MAX_COUNT = 1_000_000_000
DAY, WEEK = 86_400.0, 7 * 86_400.0


class ExportOptions(TypedDict):
    """The settings `export_step` and `export_adopted` both take, as their keyword arguments."""

    dtype: str | None
    keep_dtype: str | None
    max_shard_size: int
    threads: int
    default_shard_size: bool


class Settings(BaseSettings):
    """Everything `stagerd watch` can be told. Flags override the environment, which overrides the file."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_default=True)

    root: Path | None = Field(None, description="Staging root that the trainers write step directories into.")
    sinks: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Publish destinations (hf://ORG/REPO, s3://BUCKET/PREFIX, file:///PATH, any fsspec URL). "
        "In the environment: comma-separated or a JSON list.",
    )
    dtype: str | None = Field(
        None,
        description="Export dtype: keep|bf16|fp16|fp32, or as torch names it (bfloat16, float16, half, "
        "float32, float; any case). Unset: the commit marker's hint, else keep.",
    )
    keep_dtype: str | None = Field(None, description="Regex of tensor names that are never cast.")
    mapping: Path | None = Field(
        None,
        description="Key mapping (JSON: renames, splits, merges, RoPE rows) for steps saved without a to-Hub "
        "plan, e.g. examples/torchtitan_llama_to_hf.json.",
    )
    max_shard_size: ByteSize | None = Field(
        None,
        gt=0,
        description="Largest output safetensors file: bytes, or 5GB, 500MiB. Unset: 50GB, as save_pretrained "
        "(most models are then one model.safetensors); 5GB for a step staged on several nodes (or with "
        "exchange), since the nodes share the work by file.",
    )
    export_threads: int = Field(2, ge=1, le=MAX_WORKERS, description="Copy threads inside one export.")
    export_workers: int = Field(
        1, ge=1, le=MAX_WORKERS, description="Exports that may run at once; they start in step order."
    )
    publish_workers: int = Field(
        1,
        ge=1,
        le=MAX_WORKERS,
        description="Publishes that may run at once per sink; every sink is its own lane.",
    )
    yield_seconds: float = Field(
        30.0,
        ge=0,
        le=DAY,
        description="While a save is being written in ROOT (a step without its marker, or with --adopt a "
        "checkpoint its preset does not find finished, written in the last 3 s), exports and file:// "
        "publishes pause between their moves and chunks, at most this long in total each, over all its "
        "retries; then they run regardless. 0: never pause.",
    )
    keep_last: int | None = Field(
        None,
        ge=0,
        le=MAX_COUNT,
        description="Keep the staged data of the newest N steps; delete older steps only once they are "
        "published on every sink. Unset: delete nothing.",
    )
    once: bool = Field(
        False,
        description="Process every committed step, then exit: 0 only if all published (saves not yet "
        "finished are named, and left for the next run).",
    )
    max_attempts: int = Field(
        5,
        ge=1,
        le=MAX_COUNT,
        description="With --once: tries per stage before a retryable failure is given up for this run "
        "(the next start tries again); a sink's failed tries count in a row whichever steps they were for, "
        "so a sink that is down is tried this often in all, not per step. A running daemon retries those "
        "for as long as they fail.",
    )
    retry_base_seconds: float = Field(
        2.0, gt=0, le=WEEK, description="First retry delay; doubles per attempt."
    )
    retry_max_seconds: float = Field(300.0, gt=0, le=WEEK, description="Longest retry delay.")
    watch: bool = Field(True, description="Watch ROOT with inotify (watchfiles); the rescan runs regardless.")
    rescan_seconds: float = Field(
        5.0,
        gt=0,
        le=DAY,
        description="Full rescan period: the fallback for filesystems without inotify events.",
    )
    watch_debounce_ms: int = Field(100, ge=1, le=60_000, description="Longest batching of filesystem events.")
    grace_seconds: float = Field(
        60.0,
        ge=0,
        le=DAY,
        description="On SIGTERM/SIGINT, how long in-flight work may finish before it is abandoned.",
    )
    nice: int = Field(
        10, ge=0, le=19, description="Raise the CPU niceness to at least this (0: leave as is)."
    )
    io_class: Literal["idle", "best-effort", "none"] = Field(
        "idle", description="I/O scheduling class (ioprio): idle, best-effort, or none to leave as is."
    )
    metrics_host: str = Field(
        "127.0.0.1", description="Address of the Prometheus /metrics and /healthz server."
    )
    metrics_port: int = Field(
        9464,
        ge=0,
        le=65535,
        description="Port of the metrics server; 0 or 'off' disables it. A port in use stops the daemon "
        "from starting; with --once it is only warned about, and that run serves no metrics.",
    )
    low_disk_free_percent: float = Field(
        10.0, ge=0, le=100, description="Warn (logs, status, metrics) when ROOT's free space is below this."
    )
    low_disk_free_bytes: ByteSize = Field(
        ByteSize(0), ge=0, description="Warn when ROOT's free space is below this size, e.g. 50GB (0: off)."
    )
    disk_check_seconds: float = Field(10.0, gt=0, le=DAY, description="Period of the free-disk check.")
    publish_raw: bool = Field(
        False,
        description="Also publish every committed step's raw files (DCP shards, optim/, extras/, marker) "
        "to PREFIX/raw/step-N/ on every fsspec sink, for resuming training; a step counts as published "
        "only once its raw lanes are.",
    )
    exchange: str | None = Field(
        None,
        description="A node-locally staged step: the fsspec URL every node reaches (S3, GCS, a shared "
        "mount) where the nodes meet (raw parts, claims, file records). Unset: the first fsspec sink.",
    )
    fleet_wait_seconds: float = Field(
        600.0,
        gt=0,
        le=WEEK,
        description="A node-locally staged step: how long this node's daemon waits with nothing new from "
        "the other nodes (a part, a file's record, the leader's commit, a node's reported progress) before "
        "the try ends as FleetWaitError; never "
        "quarantined: a running daemon waits again, --once exits 1 leaving the step waiting for the next "
        "start.",
    )
    remote_keep_last: int | None = Field(
        None,
        ge=1,
        le=MAX_COUNT,
        description="Remote retention, per fsspec sink, separate from keep_last: after each publish, keep "
        "the newest N complete steps this ROOT published on that sink, or a ROOT it resumed from through "
        "`stagerd restore` (exports and raw steps; another run's steps there are never counted or "
        "deleted), never the one latest names. "
        "Unset: delete nothing. The Hub is never pruned.",
    )
    remote_keep_every: int | None = Field(
        None,
        ge=1,
        le=MAX_COUNT,
        description="Remote retention: also keep every step that is a multiple of N (with "
        "remote_keep_last). Alone: keep only those, and the newest.",
    )
    sink_retention: dict[str, str] = Field(
        default_factory=dict,
        description="Remote retention of one sink, instead of remote_keep_last/remote_keep_every: its URL -> "
        "'last=N,every=M'. Flag: --sink-retention URL=last=3,every=1000 (repeatable); environment: a JSON "
        "object.",
    )

    adopt: str | None = Field(
        None,
        description="Export the DCP checkpoints a trainer already writes under ROOT, with no Stager and no "
        "marker: auto (recognise each by its layout), hf-trainer, accelerate, automodel, lightning, "
        "torchtitan, dcp or hf (HF safetensors already). Unset: only steps saved through stagerd.Stager.",
    )
    adopt_select: str | None = Field(
        None,
        description="With adopt: a regex matched whole against each tensor key of a checkpoint; the keys it "
        "matches are the model, named by its group `name` (else its first group, else the key). Replaces "
        "the preset's selection.",
    )
    adopt_step: str | None = Field(
        None,
        description="With adopt: a regex matched whole against checkpoint directory names, the step number "
        "in its group `step` (else its first group); tried before the built-in names.",
    )
    export_dir: Path | None = Field(
        None,
        description="With adopt: where exports of adopted checkpoints are built (one directory each). "
        "Unset: ROOT/.stagerd/adopted. Never inside a checkpoint: the trainer's files are only read.",
    )
    extras: Path | None = Field(
        None,
        description="With adopt: a directory holding config.json, the tokenizer and generation_config.json "
        "for checkpoints that have none beside them (the checkpoint's own directory wins, then this, then "
        "ROOT).",
    )
    delete_adopted: bool = Field(
        False,
        description="With adopt and keep_last: also delete the trainer's own checkpoint directories beyond "
        "keep_last once published on every sink. Unset: stagerd never deletes a trainer's checkpoint "
        "(keep_last then removes only stagerd's exports of them).",
    )

    def shard_size(self, fleet: bool = False) -> int:
        """max_shard_size, or its default for a step: the nodes of a fleet (a step staged on several nodes,
        or any step of a daemon given an exchange) share the work by output file, so smaller files."""
        if self.max_shard_size is not None:
            return int(self.max_shard_size)
        return FLEET_MAX_SHARD_SIZE if fleet or self.exchange else DEFAULT_MAX_SHARD_SIZE

    def export_options(self) -> ExportOptions:
        """What a daemon's export of any step (staged or adopted) is given from these settings."""
        return ExportOptions(
            dtype=self.dtype,
            keep_dtype=self.keep_dtype,
            max_shard_size=self.shard_size(),
            threads=self.export_threads,
            default_shard_size=self.max_shard_size is None,
        )

    @model_validator(mode="after")
    def _check_adopt(self) -> Settings:
        if self.adopt is None:
            given = [n for n in ("adopt_select", "adopt_step", "export_dir", "extras") if getattr(self, n)]
            if given or self.delete_adopted:
                raise ValueError(f"{', '.join(given) or 'delete_adopted'} needs adopt (--adopt)")
        elif self.publish_raw:
            raise ValueError("publish_raw is not available with adopt: the raw files are the trainer's own")
        if self.delete_adopted and self.keep_last is None:
            # alone it deletes nothing, which a user who asked for deletion would find out only on a full disk
            raise ValueError("delete_adopted needs keep_last (--keep-last N): it deletes beyond the newest N")
        return self

    @field_validator("adopt")
    @classmethod
    def _check_adopt_preset(cls, v: str | None) -> str | None:
        from stagerd.contract.adopt.presets import preset_names, unknown_preset

        if v is not None and v not in preset_names():
            e = unknown_preset(v)
            raise ValueError(f"must be one of {'|'.join(preset_names())}, got {v!r}" + _did_you_mean(e.hint))
        return v

    @field_validator("adopt_step")
    @classmethod
    def _check_adopt_step(cls, v: str | None) -> str | None:
        from stagerd.contract.adopt.step_names import compile_step_regex

        try:
            compile_step_regex(v)
        except StagerdError as e:
            raise ValueError(e.message) from None
        return v

    @field_validator("sink_retention")
    @classmethod
    def _check_sink_retention(cls, v: dict[str, str]) -> dict[str, str]:
        from stagerd.sinks.prune import parse_policy
        from stagerd.sinks.urls import shown

        for url, text in v.items():
            if url.startswith("hf://"):
                raise ValueError(f"{shown(url)}: the Hub is not pruned (its history is immutable)")
            parse_policy(text)
        return v

    @field_validator("sinks", mode="before")
    @classmethod
    def _split_sinks(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = v.strip()
            if v.startswith("["):
                import json

                return json.loads(v)
            return [s.strip() for s in v.split(",") if s.strip()]
        return v

    @field_validator("sinks")
    @classmethod
    def _check_sinks(cls, v: list[str]) -> list[str]:
        from stagerd.sinks.own_places import check_sinks

        check_sinks(v)  # parsed, none twice, none nested: a ConfigError before anything is created
        return v

    @field_validator("exchange")
    @classmethod
    def _check_exchange(cls, v: str | None, info: ValidationInfo) -> str | None:
        from stagerd.daemon.fleet.exchange_places import refuse_exchange_among_sinks
        from stagerd.sinks.urls import SinkKind, parse_sink_url

        # As strict as a sink's: `file://relative` would put the nodes' exchange under each daemon's cwd.
        if v is not None and parse_sink_url(v, what="--exchange URL").kind is SinkKind.HUB:
            raise ValueError("the exchange is an fsspec URL (S3, GCS, a shared mount), not the Hub")
        if v is not None:  # `sinks` is validated first (declared first), and absent here if it failed
            refuse_exchange_among_sinks(v, info.data.get("sinks", []))
        return v

    @field_validator("dtype")
    @classmethod
    def _check_dtype(cls, v: str | None) -> str | None:
        from stagerd.contract.dtypes import normalise_export_dtype

        if v is None:
            return None
        try:
            return normalise_export_dtype(v)  # `bfloat16` is stored as `bf16`, as the marker's hint is
        except StagerdError as e:
            raise ValueError(e.message) from None

    @field_validator("keep_dtype", "adopt_select")
    @classmethod
    def _check_regex(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                re.compile(v)
            except re.error as e:
                raise ValueError(f"not a regular expression: {e}") from None
        return v

    @field_validator("mapping")
    @classmethod
    def _check_mapping(cls, v: Path | None) -> Path | None:
        if v is not None:
            try:
                KeyMapping.load(v)
            except StagerdError as e:  # its path: the mapping file, which the settings' error names too
                raise ValueError(str(e)) from None
        return v

    @field_validator("metrics_port", mode="before")
    @classmethod
    def _port_off(cls, v: Any) -> Any:
        if isinstance(v, str) and v.strip().lower() in ("off", "none", "false", ""):
            return 0
        return v


def settings_table() -> list[tuple[str, str, str, str]]:
    """(setting, env var, default, description) of every setting, for documentation."""
    rows = []
    for name, field in Settings.model_fields.items():
        default = field.get_default(call_default_factory=True)
        rows.append((name, f"{ENV_PREFIX}{name.upper()}", repr(default), field.description or ""))
    return rows


def _did_you_mean(hint: str | None) -> str:
    """`; did you mean X?` of a preset's error, for a setting's one line (its hint is the setting's own)."""
    return f"; {hint}" if hint and hint.startswith("did you mean") else ""
