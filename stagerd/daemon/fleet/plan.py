"""The fleet's shared plan: every node computes the same `ExportPlan` and the same owner of each output file.

A node sees its own shards on disk and the other nodes' through the exchange. `Mirror` lays every shard of
the step out under one local directory at its own name: a node's own shards are hard links, the others'
sparse files of their full size holding only their header (one ranged read each). The planner then reads
headers from that directory exactly as it reads a shared ROOT, so the plan, and therefore every output
byte, is the single-node export's. Before a node builds a file it fetches into the sparse files the byte
ranges that file's moves read, and `execute` runs on a plan cut down to that file: the same code path.
"""

from __future__ import annotations

import os
import shutil
import stat
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from stagerd.contract import commit_marker, dtypes, layout
from stagerd.contract.regular_file import linked
from stagerd.contract.step.held import HINT, WHY, HeldDir
from stagerd.engine.moves import plan_moves
from stagerd.engine.parsed_extras import PARSED_EXTRAS, read_json_object
from stagerd.engine.plan_types import ExportPlan, MoveKind
from stagerd.errors import ShardError, SinkConflictError

ReadRange = Callable[[str, int, int], bytes]  # (exchange key, start, end) -> bytes


@dataclass(frozen=True)
class NodePart:
    """One node's marker and where its raw part lives on the exchange (`raw/step-N/node-K-of-M`)."""

    node: int
    marker: commit_marker.CommitMarker
    prefix: str


def check_part(part: NodePart, listed: Mapping[str, int], url: str) -> None:
    """Every file `part`'s marker lists is in its raw part (`listed`: name -> size) at the marker's size:
    one gone was a retryable FileNotFoundError every try, one of another size read as its first bytes,
    and a size no file can have a raw OSError out of the mirror."""
    for f in part.marker.files:
        got = listed.get(f.path)
        if got != f.size:
            raise SinkConflictError(
                f"step {part.marker.step}: node {part.node}'s part on the exchange holds {f.path} "
                f"{'nowhere' if got is None else f'at {got} bytes'}, its marker lists {f.size} bytes",
                path=f"{url}/{part.prefix}/{f.path}",
                hint=f"remove {part.prefix}/ from the exchange (node {part.node} sends its part again), then "
                f"run `stagerd retry ROOT --step {part.marker.step}` on every node",
            )


def shard_names(marker: commit_marker.CommitMarker) -> dict[str, int]:
    """The model shards a marker lists: file name -> size."""
    pre = layout.MODEL_DIR + "/"
    return {f.path[len(pre) :]: f.size for f in marker.files if f.path.startswith(pre)}


class Mirror:
    """Every shard of the step under `root/model/`: own ones linked, others sparse, filled on demand.
    `pause`: after each range written into the mirror (the daemon's yield to a save on this node)."""

    def __init__(
        self,
        root: Path,
        own_step: Path,
        parts: list[NodePart],
        me: int,
        read: ReadRange,
        pause: Callable[[], None] | None = None,
    ) -> None:
        self.model = root / layout.MODEL_DIR
        self.own_step = own_step
        self.parts = parts
        self.me = me
        self.read = read
        self.pause = pause
        self.remote: dict[str, str] = {}  # mirror path -> exchange key, for the shards of other nodes
        self.have: dict[str, list[tuple[int, int]]] = {}  # mirror path -> ranges fetched, merged
        self.fetched = 0

    def build(self) -> list[str]:
        """Lay out every shard; returns their names (the planner's `listed`)."""
        if self.model.exists():
            shutil.rmtree(self.model)
        self.model.mkdir(parents=True)
        with HeldDir.open(self.own_step) as step, step.child(layout.MODEL_DIR) as model, model.naming():
            return self._lay_out(model)

    def _lay_out(self, model: HeldDir) -> list[str]:
        names: list[str] = []
        for part in self.parts:
            for name, size in shard_names(part.marker).items():
                dst = self.model / name
                if name in names:
                    raise ShardError("two nodes list the same shard", path=dst)
                if "/" in name:  # was a raw FileNotFoundError out of the mirror, whichever node staged it
                    raise ShardError(
                        f"node {part.node}'s marker lists a shard in a folder of {layout.MODEL_DIR}/, which "
                        "a fleet step never holds",
                        path=f"{part.prefix}/{layout.MODEL_DIR}/{name}",
                        hint="every node stages its shards straight under model/ (as the Stager writes "
                        "them); stage the step again",
                    )
                names.append(name)
                if part.node == self.me:
                    _link_own(model, name, dst)
                    continue
                key = f"{part.prefix}/{layout.MODEL_DIR}/{name}"
                self.remote[str(dst)] = key
                head = self.read(key, 0, 8)
                if len(head) != 8:
                    raise ShardError("is shorter than a safetensors header", path=key)
                (n,) = struct.unpack("<Q", head)
                n = min(n, max(0, size - 8))  # the header reader refuses a bad length on its own
                header = head + (self.read(key, 8, 8 + n) if n else b"")
                with open(dst, "wb") as f:
                    f.write(header)
                    f.truncate(size)
        return names

    def fill(self, ranges: Iterable[tuple[str, int, int]]) -> None:
        """Fetch from the exchange every remote byte range of `ranges` (path, offset, length): what a
        plan's moves read (`reads`), or a LoRA merge's inputs."""
        wanted: dict[str, list[tuple[int, int]]] = {}
        for src, off, n in ranges:
            if src in self.remote and n:
                wanted.setdefault(src, []).append((off, off + n))
        for src, spans in wanted.items():
            have = self.have.get(src, [])
            fd = os.open(src, os.O_WRONLY | os.O_CLOEXEC)
            try:
                # A merge's inputs are read again by another merge or a file's moves: fetched once.
                for a, b in _missing(_merged(spans), have):
                    data = self.read(self.remote[src], a, b)
                    if len(data) != b - a:
                        raise ShardError(f"short read {a}..{b}: {len(data)} bytes", path=self.remote[src])
                    os.pwrite(fd, data, a)
                    self.fetched += len(data)
                    have = _merged([*have, (a, b)])
                    self.have[src] = have
                    if self.pause is not None:
                        self.pause()
            finally:
                os.close(fd)


def _link_own(model: HeldDir, name: str, dst: Path) -> None:
    """Hard-link the shard `name` of the held `model/` to `dst`, never a link's target: the shard may have
    been replaced by a link since the raw part was sent (os.link follows one by default). Linked without
    following, `dst` is whatever was at the name; anything but a regular file there is refused."""
    os.link(name, dst, src_dir_fd=model.fd, follow_symlinks=False)
    if not stat.S_ISREG(os.lstat(dst).st_mode):
        os.unlink(dst)
        raise linked(model.path / name, WHY, HINT)


def reads(p: ExportPlan) -> Iterator[tuple[str, int, int]]:
    """(source path, offset, length) of every byte range that `p`'s moves read."""
    srcs = p.sources
    for m in plan_moves(p):
        if m.kind is MoveKind.GATHER:
            for piece in m.pieces:
                yield srcs[piece.src], piece.src_offset, piece.length
        elif m.kind is MoveKind.CAST:
            sdt, ddt = dtypes.lookup(m.src_dtype or "U8"), dtypes.lookup(m.dst_dtype or "U8")
            yield srcs[m.src], m.src_offset, m.length * sdt.bits // ddt.bits
        else:
            yield srcs[m.src], m.src_offset, m.length


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _missing(want: list[tuple[int, int]], have: list[tuple[int, int]]) -> Iterator[tuple[int, int]]:
    """The parts of the sorted disjoint ranges `want` outside the sorted disjoint ranges `have`."""
    for a, b in want:
        for x, y in have:
            if y <= a or x >= b:
                continue
            if x > a:
                yield a, x
            a = max(a, y)
        if a < b:
            yield a, b


def only_file(p: ExportPlan, name: str) -> ExportPlan:
    """`p` cut down to one output file: its header and moves are the ones the whole plan writes."""
    return replace(p, files=tuple(f for f in p.files if f.name == name))


def owners(sizes: Iterable[tuple[str, int]], nodes: int) -> dict[str, int]:
    """Each output file's owner, from (name, size): biggest file first to the node with the fewest bytes
    so far, lowest node on a tie. Pure and deterministic: every node computes the same map."""
    load = [0] * nodes
    out: dict[str, int] = {}
    for name, size in sorted(sizes, key=lambda f: (-f[1], f[0])):
        k = min(range(nodes), key=lambda i: (load[i], i))
        out[name] = k
        load[k] += size
    return out


def check_extras(step_dir: Path, marker: commit_marker.CommitMarker) -> None:
    """The extras this node staged that the export parses (`config.json`, ...) are JSON objects, as
    `export_step` checks them before anything is written (`ExtrasError`)."""
    pre = layout.EXTRAS_DIR + "/"
    for f in marker.files:
        if f.path.startswith(pre) and f.path[len(pre) :] in PARSED_EXTRAS:
            read_json_object(step_dir / f.path)


def extras_of(parts: list[NodePart]) -> Mapping[str, NodePart]:
    """Every node's extras (relative to `extras/`) -> the node that staged it (the lowest, if several)."""
    pre = layout.EXTRAS_DIR + "/"
    out: dict[str, NodePart] = {}
    for part in parts:
        for f in part.marker.files:
            rel = f.path[len(pre) :]
            if f.path.startswith(pre) and rel not in out:
                out[rel] = part
    return out
