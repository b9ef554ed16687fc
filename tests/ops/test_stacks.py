"""`stagerd.ops.stacks`: where each task awaits and each thread stands, as SIGUSR1 logs it. In process."""

from __future__ import annotations

import asyncio
import threading

from stagerd.ops import stacks


def test_a_task_is_shown_down_to_what_it_awaits_and_every_thread_is_named():
    async def inner(ev: asyncio.Event) -> None:
        await ev.wait()

    async def outer(ev: asyncio.Event) -> None:
        await inner(ev)

    async def main() -> str:
        ev = asyncio.Event()
        task = asyncio.create_task(outer(ev), name="worker")
        await asyncio.sleep(0)
        text = stacks.describe()
        ev.set()
        await task
        return text

    text = asyncio.run(main())
    worker = text.split("task worker:\n", 1)[1].split("\ntask ", 1)[0]
    # the chain of awaits, outermost first: what `Task.get_stack` alone leaves out
    assert worker.index("in outer") < worker.index("in inner") < worker.index("in wait"), text
    assert "thread MainThread:" in text, text
    assert "task " not in stacks.describe()  # no loop runs: threads only


def test_installing_from_another_thread_changes_nothing():
    errors: list[BaseException] = []

    def run() -> None:
        try:
            stacks.install()
        except BaseException as e:  # signal.signal outside the main thread: ValueError
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert errors == []
