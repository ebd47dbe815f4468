# SPDX-License-Identifier: Apache-2.0
"""Fault injection for tests on a real engine: slow the save thread's copies."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["slow_save_copies"]


@contextlib.contextmanager
def slow_save_copies(delay_s: float) -> Iterator[set[Any]]:
    """While open, every job queued on a worker's save thread sleeps ``delay_s`` before it
    runs, so a copy reads vLLM's pages that much later (as under a busy copy thread).

    Yields the set of :class:`~lmcache_vllm.worker.save_queue.SaveQueue` objects that got jobs
    (``q.wait(timeout)`` waits until their saves are published). Affects every engine of this
    process; engines in other processes are not touched.
    """
    from lmcache_vllm.worker.save_queue import SaveQueue

    queues: set[Any] = set()
    submit = SaveQueue.submit

    def slow_submit(self: SaveQueue, req_id: str, copy: Any, fence: Any = None) -> None:
        def late() -> Any:
            time.sleep(delay_s)
            return copy()

        queues.add(self)
        submit(self, req_id, late, fence)

    SaveQueue.submit = slow_submit  # type: ignore[method-assign]
    try:
        yield queues
    finally:
        SaveQueue.submit = submit  # type: ignore[method-assign]
