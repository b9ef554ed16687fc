"""The save methods `bench_goodput.py` compares, each behind one small interface.

Each method saves the live model and optimizer state dicts every K steps. `save()` is what the loop calls
after `optimizer.step()`; `before_step()` is the wait a method puts right before the next
`optimizer.step()` (stagerd's `wait_staged()`, torchtitan's `maybe_wait_for_staging()`); `settle()` is
the immediate wait of an unhidden save. Each save's record keeps when it started, how long the loop was
blocked by it, and when its host copy and its durable write finished.
"""

from __future__ import annotations

import functools
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Save:
    step: int
    t0: float
    blocked: float = 0.0  # seconds the loop waited for this save (save call + waits)
    staged_at: float | None = None
    durable_at: float | None = None


def _when(fut: Any, rec: Save, attr: str) -> None:
    """Record in `rec.attr` the time `fut` resolves (concurrent or torch future)."""

    def done(*_: Any) -> None:
        setattr(rec, attr, time.perf_counter())

    if hasattr(fut, "add_done_callback"):
        fut.add_done_callback(done)
    else:
        fut.then(done)


class _Deleter:
    """Removes finished checkpoints on a thread of its own, off the loop."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []

    def remove(self, path: Path) -> None:
        t = threading.Thread(target=shutil.rmtree, args=(path,), kwargs={"ignore_errors": True}, daemon=True)
        t.start()
        self.threads.append(t)

    def join(self) -> None:
        for t in self.threads:
            t.join()


class Method:
    name = ""
    daemon = False

    def __init__(self, model: Any, optim: Any, root: Path, threads: int) -> None:
        self.model, self.optim, self.root, self.threads = model, optim, root, threads
        self.saves: list[Save] = []

    def save(self, step: int) -> Save:
        raise NotImplementedError

    def before_step(self) -> None:
        pass

    def settle(self) -> None:
        pass

    def drain(self) -> None:
        """After a run, off the clock: the last save durable, so the next run starts on a quiet disk."""

    def close(self) -> None:
        pass

    def _blocked(self, rec: Save, fn: Any, *args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            rec.blocked += time.perf_counter() - t


class StagerdMethod(Method):
    name = "stagerd"
    daemon = True

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        from stagerd import Stager

        self.stager = Stager(self.root, writer_threads=self.threads)
        self.stager.attach(self.optim)  # reserves the host buffers after the next optimizer step

    def save(self, step: int) -> Save:
        rec = Save(step, time.perf_counter())
        self.saves.append(rec)
        handle = self._blocked(
            rec, self.stager.save, self.model.state_dict(), step, optimizer_state=self.optim.state_dict()
        )
        for f in handle.staging:
            _when(f, rec, "staged_at")
        _when(handle.committed, rec, "durable_at")
        return rec

    def before_step(self) -> None:
        if self.saves:
            self._blocked(self.saves[-1], self.stager.wait_staged)

    settle = before_step

    def drain(self) -> None:
        self.stager.wait()

    def close(self) -> None:
        self.stager.wait()
        self.stager.close()


def torch_stager_closes_after_each_save() -> bool:
    """True where torch's DefaultStager breaks on its second save of a nested dict (torch 2.11)."""
    import torch
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    st = DefaultStager(
        StagingOptions(
            use_pinned_memory=False,
            use_shared_memory=False,
            use_async_staging=False,
            use_non_blocking_copy=False,
        )
    )
    sd = {"a": {"b": torch.ones(2)}, "c": [{"d": 1}]}
    try:
        for _ in range(2):
            st.stage(sd)
        return False
    except KeyError:
        return True
    finally:
        st.close()


class _TorchAsync(Method):
    """A torch async save in flight (`pending`), its directory removed once the next one is durable."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.deleter = _Deleter()
        self.pending: Any = None
        self.last: Path | None = None

    def _wait_previous(self, rec: Save) -> None:
        if self.pending is not None:  # torchtitan waits for the previous upload first
            self._blocked(rec, self.pending.result)
            self._drop_last()

    def _drop_last(self) -> None:
        if self.last is not None:
            self.deleter.remove(self.last)
            self.last = None

    def drain(self) -> None:
        if self.pending is not None:
            self.pending.result()

    def close(self) -> None:
        self.drain()
        self._drop_last()
        self.deleter.join()


class TorchBest(_TorchAsync):
    """dcp.async_save, PROCESS checkpointer + DefaultStager(pinned, shared, async): torchtitan's
    async_with_pinned_mem, with its FileSystemWriter given as many threads as stagerd's writer."""

    name = "dcp.async_save PROCESS+pinned"

    def __init__(self, *args: Any, patch_close: bool) -> None:
        super().__init__(*args)
        import torch
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self._unpatch = None
        if patch_close:  # torch 2.11's close-after-every-save: made a no-op, as the issue measured it
            from torch.distributed.checkpoint._state_dict_stager import StateDictStager

            original = StateDictStager.close
            StateDictStager.close = lambda self: None  # type: ignore[method-assign]
            self._unpatch = functools.partial(setattr, StateDictStager, "close", original)
        cuda = torch.cuda.is_available()
        self.stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=True,
                use_async_staging=True,
                use_non_blocking_copy=cuda,
            )
        )
        self.staging: Any = None

    def save(self, step: int) -> Save:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        rec = Save(step, time.perf_counter())
        self.saves.append(rec)
        self._wait_previous(rec)
        path = self.root / f"best-{step}"
        sd = {"model": self.model.state_dict(), "optim": self.optim.state_dict()}
        resp = self._blocked(
            rec,
            functools.partial(
                dcp.async_save,
                sd,
                storage_writer=FileSystemWriter(path, thread_count=self.threads),
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                async_stager=self.stager,
            ),
        )
        self.pending, self.staging, self.last = resp.upload_completion, resp.staging_completion, path
        _when(resp.staging_completion, rec, "staged_at")
        _when(resp.upload_completion, rec, "durable_at")
        return rec

    def before_step(self) -> None:
        if self.staging is not None:
            staging, self.staging = self.staging, None
            self._blocked(self.saves[-1], staging.result)

    settle = before_step

    def close(self) -> None:
        super().close()
        self.stager.close()
        if self._unpatch is not None:
            self._unpatch()
        from torch.distributed.checkpoint import _async_process_executor as executor

        executor._CHECKPOINT_PROCESS = None  # its __del__ stops the checkpoint process


class TorchAsyncDefault(_TorchAsync):
    """dcp.async_save with torch's defaults (thread checkpointer; it copies to host before it returns)."""

    name = "dcp.async_save defaults"

    def save(self, step: int) -> Save:
        import torch.distributed.checkpoint as dcp

        rec = Save(step, time.perf_counter())
        self.saves.append(rec)
        self._wait_previous(rec)
        path = self.root / f"async-{step}"
        sd = {"model": self.model.state_dict(), "optim": self.optim.state_dict()}
        fut = self._blocked(rec, functools.partial(dcp.async_save, sd, checkpoint_id=path))
        rec.staged_at = time.perf_counter()
        self.pending, self.last = fut, path
        _when(fut, rec, "durable_at")
        return rec


class TorchSave(Method):
    name = "dcp.save"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.deleter = _Deleter()

    def save(self, step: int) -> Save:
        import torch.distributed.checkpoint as dcp

        rec = Save(step, time.perf_counter())
        self.saves.append(rec)
        path = self.root / f"sync-{step}"
        sd = {"model": self.model.state_dict(), "optim": self.optim.state_dict()}
        self._blocked(rec, functools.partial(dcp.save, sd, checkpoint_id=path))
        rec.staged_at = rec.durable_at = time.perf_counter()
        self.deleter.remove(path)
        return rec

    def close(self) -> None:
        self.deleter.join()
