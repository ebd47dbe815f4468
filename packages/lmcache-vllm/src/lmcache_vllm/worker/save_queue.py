# SPDX-License-Identifier: Apache-2.0
"""Saves off the step: a two-stage pipeline of copy jobs and commit jobs on background threads.

The worker queues the planning of a step's saves at the forward's last layer (a job on the copy
thread, while the step computes) and their copy in ``wait_for_save``, returning at once. A save
is two jobs after its plan:

1. **copy** (copier thread, in submission order): copies the KV out of vLLM's pages into leased
   host buffers (``LMCacheEngine.copy_out``). On CUDA it only *enqueues* the copy on a store
   stream ordered after the step's compute (a gather of the pages into device staging, then
   DMAs to the host) and releases the job's :class:`ReadFence` with a CUDA event recorded right
   after the gather: from that event on the pages may change.
2. **commit** (committer thread): waits for the copy to reach the host (on CUDA, asleep on a
   blocking-sync event rather than polling the driver for the length of a forward), checksums
   the buffers and publishes the chunks, so they become visible to lookups only when complete.
   It reads host memory only.

vLLM may reuse a request's blocks once it finished or was preempted, but only a *later* step
writes them.
Every step starts with :meth:`SaveQueue.wait_read` (the worker's ``bind_connector_metadata``).
It waits on the host until every queued copy has released its fence, normally at once, since
enqueueing takes well under a millisecond.
It returns their events, which the step's streams wait on *on the device*.
So a block is never rewritten while a save reads it, and the step never waits on the host for a
transfer.
vLLM therefore frees blocks at once (``request_finished`` returns ``False``), as its own
OffloadingConnector does.

On CUDA a commit's Python (publishing a step's chunks: about a millisecond for a 16k-token save)
is held back by a :class:`QuietGate`.
The gate opens once vLLM's thread is likely waiting on the device (a later forward is enqueued
and still running).
The commit then does not compete for the GIL with the scheduling and input preparation of the
next step, while the GPU waits for them.
Anyone who needs the chunks published (a lookup of the same prompt, a reset, shutdown) hurries
the gate.

A job that raises is logged and dropped (its chunks are not stored); the threads never die of it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["CommitJob", "CopyJob", "QuietGate", "ReadFence", "SaveQueue", "UnpublishedSaves"]

logger = logging.getLogger(__name__)

CommitJob = Callable[[], None]
"""Publishes what a copy staged (may run on another thread)."""
CopyJob = Callable[[], CommitJob | None]
"""Copies a save's bytes; returns its commit job (``None``: nothing to commit)."""


class ReadFence:
    """When one queued copy stops reading the engine's pages.

    Released (once) by the copy job, with the CUDA event after which the pages may change, or
    by the queue with ``None`` when the job returns without releasing it (its reads are then
    complete on the host).
    """

    def __init__(self) -> None:
        self._released = threading.Event()
        self.event: Any = None

    def release(self, event: Any = None) -> None:
        """The pages are read once ``event`` completes (``None``: already); later calls are
        ignored."""
        if not self._released.is_set():
            self.event = event
            self._released.set()

    def wait(self, timeout: float | None) -> bool:
        """Whether the fence was released within ``timeout`` seconds."""
        return self._released.wait(timeout)


class QuietGate:
    """Holds a commit back until vLLM's thread is likely waiting on the device.

    vLLM's thread enqueues a forward, then waits for the GPU; when the GPU is done, vLLM's
    thread processes the output and schedules and prepares the next step while the GPU idles.
    A background thread running Python then (holding the GIL) delays that thread, and the GPU
    with it.
    With vLLM's asynchronous scheduling the next step is usually enqueued before the current one
    finishes, so under load the gate is open nearly always.
    It matters when the engine runs one request at a time, and between batches.

    The worker calls :meth:`forward_enqueued` with a CUDA event recorded after each forward it
    enqueued.
    A commit waits in :meth:`wait` until one of these holds:

    - the latest such event has not completed yet (the GPU is busy with a forward, and vLLM's
      thread waits on it);
    - someone hurries (:meth:`hurry`: a lookup of the chunks, a reset, shutdown);
    - :attr:`max_wait_s` passed (the engine went idle).

    Args:
        max_wait_s: Longest a commit is held back.
    """

    def __init__(self, max_wait_s: float = 0.05) -> None:
        self.max_wait_s = max_wait_s
        self._cond = threading.Condition()
        self._event: Any = None
        self._hurried = 0
        self._waiting = 0
        self._closed = False

    @property
    def waiting(self) -> bool:
        """Whether a commit is held back (the worker records an event only then)."""
        return self._waiting > 0

    def forward_enqueued(self, event: Any) -> None:
        """A forward was enqueued; ``event`` (with ``query()``) completes when it is done."""
        with self._cond:
            self._event = event
            self._cond.notify_all()

    @contextlib.contextmanager
    def hurry(self) -> Iterator[None]:
        """While inside, nothing is held back."""
        with self._cond:
            self._hurried += 1
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._hurried -= 1

    def close(self) -> None:
        """Hold nothing back from now on."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _open(self) -> bool:
        if self._hurried or self._closed:
            return True
        event = self._event
        return event is not None and not event.query()

    def wait(self) -> None:
        """Return when a commit may run (see the class docstring)."""
        deadline = time.monotonic() + self.max_wait_s
        with self._cond:
            self._waiting += 1
            try:
                while not self._open():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return
                    self._cond.wait(left)
            finally:
                self._waiting -= 1


class _Stage:
    """One worker thread over a FIFO, with a count of queued + running jobs."""

    def __init__(self, name: str, run: Callable[[str, Callable[[], object]], None]) -> None:
        self.jobs: deque[tuple[str, Callable[[], object]]] = deque()
        self.pending = 0
        self.cond = threading.Condition()
        self.closed = False
        self._run_one = run
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def put(self, req_id: str, job: Callable[[], object]) -> None:
        with self.cond:
            if self.closed:
                raise RuntimeError("SaveQueue.submit after close(); the worker is shutting down")
            self.pending += 1
            self.jobs.append((req_id, job))
            self.cond.notify_all()

    def wait_idle(self, deadline: float | None) -> bool:
        with self.cond:
            while self.pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.cond.wait(left)
            return True

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self.jobs and not self.closed:
                    self.cond.wait()
                if not self.jobs:
                    return  # closed and drained
                req_id, job = self.jobs.popleft()
            try:
                self._run_one(req_id, job)
            finally:
                with self.cond:
                    self.pending -= 1
                    self.cond.notify_all()


class SaveQueue:
    """Copy jobs in submission order on one thread, their commits on another.

    Args:
        name: Prefix of the two thread names.
    """

    def __init__(self, name: str = "lmcache-save") -> None:
        self.gate = QuietGate()
        """Commit jobs call ``gate.wait()`` before publishing (see :class:`QuietGate`)."""
        self._commits = _Stage(f"{name}-commit", self._run_commit)
        self._copies = _Stage(f"{name}-copy", self._run_copy)
        self._fences: deque[ReadFence] = deque()
        self._fences_lock = threading.Lock()

    def submit(self, req_id: str, copy: CopyJob, fence: ReadFence | None = None) -> None:
        """Queue a save of ``req_id``: ``copy`` runs after every copy queued before it, then
        the commit job it returns. ``copy`` may release ``fence`` early (see
        :class:`ReadFence`); the queue releases it when ``copy`` returns.

        Raises:
            RuntimeError: the queue is closed.
        """
        fence = fence if fence is not None else ReadFence()
        with self._fences_lock:
            self._fences.append(fence)
        try:
            self._copies.put(req_id, partial(self._fenced, copy, fence))
        except BaseException:
            fence.release()
            raise

    @staticmethod
    def _fenced(copy: CopyJob, fence: ReadFence) -> CommitJob | None:
        try:
            return copy()
        finally:
            fence.release()

    def _run_copy(self, req_id: str, job: Callable[[], object]) -> None:
        try:
            commit = job()
        except BaseException:
            logger.exception(
                "lmcache: save of request %s failed; its chunks are not stored", req_id
            )
            return
        if callable(commit):
            self._commits.put(req_id, commit)

    def wait_read(self, timeout: float | None = None) -> list[Any] | None:
        """Wait on the host until every copy queued so far has released its fence.

        Returns:
            The CUDA events of those fences not returned before (the caller's streams must wait
            on them before rewriting pages), or ``None`` when ``timeout`` seconds passed first.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._fences_lock:
            pending = list(self._fences)
        for fence in pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not fence.wait(left):
                return None
        events = []
        with self._fences_lock:
            while self._fences and self._fences[0].wait(0):
                fence = self._fences.popleft()
                if fence.event is not None:
                    events.append(fence.event)
        return events

    @staticmethod
    def _run_commit(req_id: str, job: Callable[[], object]) -> None:
        try:
            job()
        except BaseException:
            logger.exception(
                "lmcache: save of request %s failed; its chunks are not stored", req_id
            )

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every queued save is copied and committed.

        Returns:
            ``False`` when ``timeout`` seconds passed first.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.gate.hurry():
            return self._copies.wait_idle(deadline) and self._commits.wait_idle(deadline)

    def close(self, timeout: float | None = 60.0) -> bool:
        """Finish what is queued, then stop both threads (idempotent).

        Returns:
            ``False`` when the queue did not drain within ``timeout`` seconds.
        """
        self.gate.close()
        drained = self.wait(timeout)
        self._copies.close()
        self._commits.close()
        if drained:
            self._copies.thread.join(timeout)
            self._commits.thread.join(timeout)
        return drained


class UnpublishedSaves:
    """Saves queued but not yet visible to lookups, so a lookup can wait for one it needs.

    Without this a prompt sent again right after its first run could miss KV that is still
    being copied or checksummed. Thread-safe.

    Args:
        chunk_size: Tokens per chunk.
    """

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self._saves: dict[int, tuple[str, list[int]]] = {}
        self._cond = threading.Condition()
        self._next = 0

    def add(self, salt: str, tokens: list[int]) -> int:
        """Note a queued save of ``tokens`` under ``salt``; returns its id for :meth:`done`."""
        with self._cond:
            job = self._next
            self._next += 1
            self._saves[job] = (salt, tokens)
        return job

    def done(self, job: int) -> None:
        """The save ``job`` is published (or failed)."""
        with self._cond:
            self._saves.pop(job, None)
            self._cond.notify_all()

    def wait_for(
        self,
        salt: str,
        tokens: Sequence[int] | npt.NDArray[Any],
        found: int,
        timeout: float = 0.5,
        hurry: Callable[[], contextlib.AbstractContextManager[object]] | None = None,
    ) -> bool:
        """Wait (at most ``timeout`` s) for queued saves that would extend a hit of ``found``
        tokens: same salt, same tokens through the first missing chunk; inside ``hurry()``
        (e.g. :meth:`QuietGate.hurry`) while it waits.

        Returns:
            Whether there was such a save (look again).
        """
        cut = min(len(tokens), (found // self.chunk_size + 1) * self.chunk_size)
        if cut <= 0:
            return False
        first, last = int(tokens[0]), int(tokens[cut - 1])
        want: list[int] | None = None

        def _blocking() -> bool:
            nonlocal want
            for s, t in self._saves.values():
                # most saves differ in their first or last needed token: no slice compared
                if s != salt or len(t) < cut or t[0] != first or t[cut - 1] != last:
                    continue
                if want is None:  # ints (an array's are compared as such, not per scalar)
                    head = tokens[:cut]
                    want = head.tolist() if isinstance(head, np.ndarray) else list(head)
                if t[:cut] == want:
                    return True
            return False

        with self._cond:
            if not _blocking():
                return False
        with hurry() if hurry is not None else contextlib.nullcontext(), self._cond:
            self._cond.wait_for(lambda: not _blocking(), timeout)
        return True
