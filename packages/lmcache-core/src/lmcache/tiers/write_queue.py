# SPDX-License-Identifier: Apache-2.0
"""The asynchronous write queue of a lower tier: one writer thread, a byte limit, chain runs.

:class:`WriteQueue` admits a run of one key chain head first while it has room.
A chunk that does not fit is dropped and counted; the caller never waits.
Each queued chunk holds a share of its host lease until it is written or dropped.
Runs for a tier that chooses its own victims are written head first, and a chunk after a failed
one is dropped, since it would be an orphan.
What a write does and what happens after a run is the tier's business, given as two callables.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lmcache.memory import MemoryLease
    from lmcache.metrics import LMCacheMetrics

__all__ = ["QueuedWrite", "WriteQueue"]


@dataclass(eq=False)
class _Run:
    """A run of one chain being written head first (tiers that choose their victims)."""

    remaining: int  # writes of the run not done yet
    written: list[bytes] = field(default_factory=list)  # keys written, in chain order
    broken: bool = False  # a write was declined, failed or dropped: the rest are orphans


@dataclass(eq=False)
class QueuedWrite:
    """One chunk waiting for the writer thread.

    Attributes:
        fingerprint: The storing engine's fingerprint digest.
        key: The chunk key.
        lease: A share of the chunk's host lease, released once written or dropped.
        checksum: The bytes' checksum if the caller had it, else ``None``.
        metrics: Where the write's outcome is counted.
        parent: The chain parent's key, kept only for runs written head first.
    """

    fingerprint: bytes
    key: bytes
    lease: MemoryLease
    checksum: int | None
    metrics: LMCacheMetrics
    parent: bytes | None = None
    run: _Run | None = None


class WriteQueue:
    """Queued writes of one tier and the thread that performs them. Thread-safe.

    Args:
        limit: Bytes of queued writes beyond which new ones are dropped (one write is always
            admitted into an empty queue).
        thread_name: Name of the writer thread (started on the first write).
        head_first: Write runs head first with their parents (a tier that chooses its victims);
            otherwise tail first, so the head is the most recently written.
        write: Performs one write; returns whether the chunk was written.
        run_written: Called with the first write of a run and the run's keys written, in chain
            order, once a head-first run of more than one written chunk is done.
    """

    def __init__(
        self,
        limit: int,
        thread_name: str,
        *,
        head_first: bool,
        write: Callable[[QueuedWrite], bool],
        run_written: Callable[[QueuedWrite, list[bytes]], None],
    ) -> None:
        self._limit = limit
        self._thread_name = thread_name
        self._head_first = head_first
        self._write = write
        self._run_written = run_written
        self._queue: deque[QueuedWrite] = deque()
        self._queued_bytes = 0
        self._busy = 0
        self._cond = threading.Condition()
        self._writer: threading.Thread | None = None
        self._closed = False

    def submit(
        self,
        fingerprint: bytes,
        chunks: Sequence[tuple[bytes, MemoryLease, int | None]],
        parents: Sequence[bytes | None],
        metrics: LMCacheMetrics,
    ) -> int:
        """Queue the leading chunks of a run that fit; count the rest as dropped writes.

        Returns:
            How many leading chunks were queued.
        """
        head_first = self._head_first
        admitted: list[QueuedWrite] = []
        with self._cond:
            queued = self._queued_bytes
            for (key, lease, checksum), parent in zip(chunks, parents, strict=True):
                if self._closed or (
                    (self._queue or admitted) and queued + lease.nbytes > self._limit
                ):
                    break
                admitted.append(
                    QueuedWrite(
                        fingerprint,
                        key,
                        lease.share(),
                        checksum,
                        metrics,
                        parent if head_first else None,
                    )
                )
                queued += lease.nbytes
            if head_first and admitted:
                run = _Run(len(admitted))
                for item in admitted:
                    item.run = run
                self._queue.extend(admitted)
            else:
                self._queue.extend(reversed(admitted))
            self._queued_bytes = queued
            if admitted and self._writer is None:
                self._writer = threading.Thread(
                    target=self._write_loop, name=self._thread_name, daemon=True
                )
                self._writer.start()
            self._cond.notify_all()
        if len(admitted) < len(chunks):
            metrics.dropped_writes.inc(len(chunks) - len(admitted))
        return len(admitted)

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                item = self._queue.popleft()
                self._busy += 1
            try:
                self._write_one(item)
            finally:
                nbytes = item.lease.nbytes
                item.lease.release()
                with self._cond:
                    self._busy -= 1
                    self._queued_bytes -= nbytes
                    self._cond.notify_all()

    def _write_one(self, item: QueuedWrite) -> None:
        run = item.run
        if run is not None and run.broken:
            item.metrics.dropped_writes.inc()  # its parent was not written: an orphan
            written = False
        else:
            written = self._write(item)
        if run is None:
            return
        if written:
            run.written.append(item.key)
        else:
            run.broken = True
        run.remaining -= 1
        if run.remaining == 0 and len(run.written) > 1:  # one chunk is the most recent
            self._run_written(item, run.written)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done; returns ``False`` on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    @property
    def pending(self) -> int:
        """Writes queued or in progress."""
        with self._cond:
            return len(self._queue) + self._busy

    def close(self, timeout: float) -> bool:
        """Refuse new writes, finish queued ones (up to ``timeout`` s), drop the rest.

        Returns:
            ``False`` when the queue was closed already (nothing done).
        """
        with self._cond:
            if self._closed:
                return False
            self._closed = True
            self._cond.notify_all()
        self.flush(timeout)
        with self._cond:
            dropped = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for item in dropped:
            item.metrics.dropped_writes.inc()
            item.lease.release()
        writer = self._writer
        if writer is not None:
            writer.join(timeout)
        return True
