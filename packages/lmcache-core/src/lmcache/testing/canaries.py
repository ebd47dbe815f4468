# SPDX-License-Identifier: Apache-2.0
"""Canaries: host memory that lmcache handed back, filled with a pattern and watched.

A stress test wraps its run in :func:`watch_host_memory`. While it runs, every allocation that a
host pool (:class:`~lmcache.memory.HostMemoryPool`) takes back from its last lease is filled with
:data:`PATTERN`. The bytes are remembered until a pool hands them out again. A copy (DMA) that
lmcache did not wait for, landing after the memory was released, overwrites the pattern. The
pattern is checked when a pool hands the bytes out again. Bytes still released at the end are
checked by :meth:`Canaries.check`, after it waits for the device. The CPU tier may hand an
evicted chunk's buffer straight to a new store of the same shape: those bytes never go back to
the pool, so they get no canary.

These hooks work on a real GPU, where a late DMA does land late. On the recording stand-in
(:class:`~lmcache.testing.recording_backend.RecordingBackend`) every copy moves its bytes at
once, so nothing can land late. There the canaries watch each copy as it is queued instead:

- A copy that writes or reads released bytes is flagged.
- Bytes handed back to a pool, handed out by one, or handed from an evicted chunk to a new store
  are flagged while a copy on them is in flight, i.e. not yet waited for by the host
  (:meth:`RecordingBackend.in_flight
  <lmcache.testing.recording_backend.RecordingBackend.in_flight>`). A lease released early is
  harmless while other leases hold its bytes, so it shows when the last one goes or when the
  tier evicts the chunk.
- A copy still *reading* such bytes is harmless when nothing uses what it read (a device copy of
  a hit that is dropped unused). The caller names those copies (``benign``): they are counted,
  not flagged.
- The backend's own findings (a ``pinned_empty`` buffer freed under a copy) are reported too.

Transient page-locked buffers (index uploads, checksum read-backs) are freed to torch, not to a
pool, so they get no canary. On the stand-in their frees are checked against copies in flight.
On a GPU they are not watched.
"""

from __future__ import annotations

import bisect
import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence

import torch

from lmcache.devices import DeviceBackend
from lmcache.memory.lease import Allocation, MemoryLease
from lmcache.memory.pinned_pool import HostMemoryPool
from lmcache.metrics import LMCacheMetrics
from lmcache.testing.recording_backend import InFlight, RecordingBackend
from lmcache.tiers.cpu_tier import CPUTier

__all__ = ["PATTERN", "Canaries", "watch_host_memory"]

PATTERN = 0xDB
"""The byte released host memory is filled with (no value a test writes on purpose)."""

_MAX_REPORTED = 50  # violations kept word for word; the rest are only counted


class Canaries:
    """Released host memory, filled with :data:`PATTERN`, and the misuses seen so far.

    Args:
        backend: The device backend the copies go through. It is synchronised before the
            final check. A :class:`RecordingBackend` is also watched copy by copy.
        benign: Says of a copy that only reads bytes handed back while in flight whether its
            result is dropped unused (counted in :attr:`abandoned`, not a violation).

    Attributes:
        violations: What went wrong, one line each (the first few; see :attr:`count`).
        count: Violations seen in all.
        released: Allocations filled with the pattern so far.
        reused: Released byte ranges handed out again (and checked) so far.
        recycled: Evicted chunks' buffers handed straight to new stores so far.
        abandoned: Copies in flight, reading bytes handed back, that ``benign`` excused.
    """

    def __init__(
        self,
        backend: DeviceBackend | None = None,
        benign: Callable[[InFlight], bool] | None = None,
    ) -> None:
        self.backend = backend
        self.benign = benign
        self.abandoned = 0
        self.violations: list[str] = []
        self.count = 0
        self.released = 0
        self.recycled = 0
        self.reused = 0
        self._lock = threading.Lock()
        self._starts: list[int] = []  # sorted starts of the released ranges
        self._spans: dict[int, tuple[int, torch.Tensor]] = {}  # start -> (end, its bytes)

    @property
    def recording(self) -> RecordingBackend | None:
        """The backend, when it is the recording stand-in."""
        backend = self.backend
        return backend if isinstance(backend, RecordingBackend) else None

    def _flag(self, message: str) -> None:
        with self._lock:
            self.count += 1
            if len(self.violations) < _MAX_REPORTED:
                self.violations.append(message)

    def _in_flight(self, start: int, end: int, what: str) -> None:
        rec = self.recording
        late = rec.in_flight(start, end) if rec is not None else []
        writes = [c for c in late if any(a < end and start < b for a, b in c.writes)]
        benign = self.benign
        excused = [c for c in late if c not in writes and benign is not None and benign(c)]
        if excused:
            with self._lock:
                self.abandoned += len(excused)
        if len(late) > len(excused):
            labels = sorted({repr(c.label) for c in late if c not in excused})
            self._flag(
                f"{what} ({end - start} bytes at {start:#x}) while {len(late) - len(excused)} "
                f"copies on them ({len(writes)} writing; {', '.join(labels)}) were in flight: "
                "the host never waited for them"
            )

    # -- the pool's hooks ---------------------------------------------------------------------

    def on_recycle(self, lease: MemoryLease) -> None:
        """The tier hands an evicted chunk's buffer to a new store: nothing may still copy it."""
        with self._lock:
            self.recycled += 1
        start = lease.tensor.data_ptr()
        self._in_flight(start, start + lease.nbytes, "an evicted chunk's buffer reused")

    def on_release(self, region: torch.Tensor) -> None:
        """A pool took ``region`` (uint8, contiguous) back: fill it and remember it."""
        if region.numel() == 0:
            return
        start = region.data_ptr()
        end = start + region.numel()
        self._in_flight(start, end, "memory handed back to its pool")
        region.fill_(PATTERN)
        with self._lock:
            self.released += 1
            for s in self._overlapping(start, end):  # never (a lease is released once): be safe
                self._cut(s, start, end)
            bisect.insort(self._starts, start)
            self._spans[start] = (end, region)

    def on_reuse(self, start: int, nbytes: int) -> None:
        """A pool handed ``[start, start + nbytes)`` out again: its pattern must be intact."""
        if nbytes <= 0:
            return
        end = start + nbytes
        self._in_flight(start, end, "memory handed out again")
        with self._lock:
            hit = self._overlapping(start, end)
            spans = [(s, *self._spans[s]) for s in hit]
            for s in hit:
                self._cut(s, start, end)
            self.reused += len(hit)
        for s, e, region in spans:
            lo, hi = max(s, start), min(e, end)
            bad = _changed(region[lo - s : hi - s])
            if bad:
                self._flag(
                    f"{bad} bytes of {hi - lo} at {lo:#x} changed between their release and "
                    "their reuse (a copy into memory handed back)"
                )

    def on_copy(self, copy: InFlight) -> None:
        """A copy was queued on the recording stand-in: it must not touch released bytes."""
        for kind, ranges in (("wrote into", copy.writes), ("read from", copy.reads)):
            for lo, hi in ranges:
                with self._lock:
                    hit = bool(self._overlapping(lo, hi))
                if hit:
                    self._flag(
                        f"a copy {kind} host memory handed back ({hi - lo} bytes at {lo:#x})"
                    )

    # -- the released ranges (callers hold the lock) -----------------------------------------

    def _overlapping(self, start: int, end: int) -> list[int]:
        i = max(0, bisect.bisect_right(self._starts, start) - 1)
        out = []
        while i < len(self._starts) and self._starts[i] < end:
            s = self._starts[i]
            if self._spans[s][0] > start:
                out.append(s)
            i += 1
        return out

    def _cut(self, s: int, start: int, end: int) -> None:
        """Forget ``[start, end)`` of the released range at ``s``; keep what lies outside."""
        e, region = self._spans.pop(s)
        self._starts.remove(s)
        if s < start:
            self._spans[s] = (start, region[: start - s])
            bisect.insort(self._starts, s)
        if end < e:
            self._spans[end] = (e, region[end - s :])
            bisect.insort(self._starts, end)

    # -- the end --------------------------------------------------------------------------------

    def check(self) -> list[str]:
        """Wait for the device, then check every range still released; returns every
        violation seen (the recording backend's included)."""
        if self.backend is not None and self.backend.has_streams:
            self.backend.synchronize()
        with self._lock:
            spans = [(s, *self._spans[s]) for s in self._starts]
        for s, e, region in spans:
            bad = _changed(region)
            if bad:
                self._flag(
                    f"{bad} bytes of {e - s} at {s:#x}, released and never reused, no longer "
                    "hold the canary (a copy landed after its memory was handed back)"
                )
        rec = self.recording
        found = list(rec.violations) if rec is not None else []
        return self.violations + found

    def assert_clean(self) -> None:
        """Raise ``AssertionError`` listing the violations, if any (after :meth:`check`)."""
        found = self.check()
        if found:
            more = self.count - len(self.violations)
            tail = f"\n... and {more} more" if more > 0 else ""
            raise AssertionError(
                f"{len(found) + max(more, 0)} host-memory violations:\n" + "\n".join(found) + tail
            )


def _changed(region: torch.Tensor) -> int:
    """Bytes of ``region`` (uint8) that no longer hold the pattern."""
    return int((region != PATTERN).sum()) if region.numel() else 0


@contextlib.contextmanager
def watch_host_memory(
    backend: DeviceBackend | None = None, benign: Callable[[InFlight], bool] | None = None
) -> Iterator[Canaries]:
    """Fill and watch the memory every :class:`HostMemoryPool` takes back, while inside.

    ``backend``, ``benign``: see :class:`Canaries`. Call :meth:`Canaries.assert_clean` at the
    end, before the pools are dropped.
    """
    canaries = Canaries(backend, benign)
    free = HostMemoryPool._free
    allocate_many = HostMemoryPool.allocate_many
    evict = CPUTier._evict

    def _evict(
        self: CPUTier,
        keys: list[bytes],
        counts: LMCacheMetrics,
        shape: tuple[int, ...] = (),
        dtype: torch.dtype | None = None,
        want: int = 0,
    ) -> list[MemoryLease]:
        reused = evict(self, keys, counts, shape, dtype, want)
        for lease in reused:
            canaries.on_recycle(lease)
        return reused

    def _free(self: HostMemoryPool, alloc: Allocation) -> None:  # under the pool's lock
        canaries.on_release(alloc.slab.tensor[alloc.offset : alloc.offset + alloc.size])
        free(self, alloc)

    def _allocate_many(
        self: HostMemoryPool, shape: Sequence[int], dtype: torch.dtype, count: int
    ) -> list[MemoryLease]:
        leases = allocate_many(self, shape, dtype, count)
        for lease in leases:  # nobody has the lease yet: nothing writes it meanwhile
            canaries.on_reuse(lease.tensor.data_ptr(), lease.pool_bytes)
        return leases

    rec = canaries.recording
    watch: Callable[[InFlight], None] = canaries.on_copy
    HostMemoryPool._free = _free  # type: ignore[method-assign]
    HostMemoryPool.allocate_many = _allocate_many  # type: ignore[method-assign]
    CPUTier._evict = _evict  # type: ignore[method-assign]
    if rec is not None:
        rec.copy_watchers.append(watch)
    try:
        yield canaries
    finally:
        HostMemoryPool._free = free  # type: ignore[method-assign]
        HostMemoryPool.allocate_many = allocate_many  # type: ignore[method-assign]
        CPUTier._evict = evict  # type: ignore[method-assign]
        if rec is not None:
            rec.copy_watchers.remove(watch)
