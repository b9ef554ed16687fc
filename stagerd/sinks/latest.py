"""A sink's `latest` pointer: the name of its newest published step, moved only forward and only once a
step is whole (every staging node's part of a raw step committed)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from stagerd.contract import layout
from stagerd.sinks.fetch import LATEST_NAME, RAW_DIR, node_parts
from stagerd.sinks.objects import MAX_LATEST_BYTES, Backend, LatestStore, foreign_latest, newer_latest


class LatestMixin:
    """`FsspecSink`'s `latest`: what it needs from the sink is declared here."""

    _backend: Backend
    _call: Callable[[Callable[[], Any], str], Any]
    _where: Callable[..., str]

    def move_latest(self, step: int) -> None:
        """Point `latest` at a committed `step` unless it names a newer one (a commit killed before it)."""
        self._move_latest(layout.step_dir_name(step), step)

    @staticmethod
    def _latest_key(prefix: str) -> str:
        return f"{RAW_DIR}/{LATEST_NAME}" if prefix.startswith(f"{RAW_DIR}/") else LATEST_NAME

    def _move_latest(self, prefix: str, step: int) -> None:
        """Point `latest` at `step` unless it names a newer one, or the step is not whole yet."""
        if not self._whole(prefix):
            return
        key = self._latest_key(prefix)
        b = self._backend
        name = layout.step_dir_name(step).encode()
        if isinstance(b, LatestStore):
            atomic = b
            self._call(lambda: atomic.move_latest(key, name, step), key)
            return
        current = self._call(lambda: b.read(key, MAX_LATEST_BYTES + 1), key)
        foreign_latest(current, self._where(key))
        if newer_latest(current, step) and current != name:
            self._call(lambda: b.write(key, name), key)

    def _whole(self, prefix: str) -> bool:
        """False for one staging node's part of a raw step (`raw/step-N/node-K-of-M`) while another node's
        part has no manifest: `restore` needs every node's part, so `raw/latest` must not name the step
        yet. Each node lists after creating its own manifest, so the last of them sees them all."""
        step_prefix = prefix.rpartition("/")[0]
        if not step_prefix.startswith(f"{RAW_DIR}/") or step_prefix.count("/") != 1:
            return True
        return node_parts(self._call(lambda: self._backend.list(step_prefix), step_prefix))[1]
