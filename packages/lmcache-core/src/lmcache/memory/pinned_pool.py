# SPDX-License-Identifier: Apache-2.0
"""A host memory pool with a fixed byte budget, handing out slices as explicit leases.

The pool owns a few large host tensors (*slabs*, ``uint8 [slab_bytes]``; pinned when a CUDA
device is present) and carves allocations out of them. Pageable slabs are allocated lazily, when
an allocation needs one. Pinned slabs are made ahead of need by a background thread that pins the
budget slab by slab from construction on (pinning runs at about 1.7 GB/s: inside a store it would
hold the request), so the engine starts at once and stores find pinned memory waiting; only an
allocation that outruns that thread pins a slab itself. An allocation larger than ``slab_bytes``
gets a slab of its own, returned to the system when it is released.

Every allocation is handed out as a :class:`MemoryLease`. The bytes go back to the pool only when
the last lease on them is released (``lease.share()`` makes another lease on the same bytes), so
a chunk that is being copied can never be reused underneath the copy::

    pool = HostMemoryPool(1 << 30)
    lease = pool.allocate((num_layers, 256, kv_width), torch.bfloat16)
    if lease is not None:
        with lease:
            lease.tensor.copy_(kv)  # [num_layers, 256, kv_width]

``pool.allocate_many(shape, dtype, count)`` leases up to ``count`` buffers of one shape in one
pass (one lock, pieces carved back to back where a free range holds several), as a store does for
a request's chunks.

The pool is thread-safe: one lock guards the free lists and the lease counts.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Callable, Iterator, Sequence

import torch

from lmcache.devices import DeviceBackend, get_backend, host_backend
from lmcache.errors import LeaseError
from lmcache.memory.lease import Allocation, MemoryLease, lease_refs
from lmcache.memory.slab import ALIGNMENT, Slab, aligned_bytes

__all__ = ["ALIGNMENT", "HostMemoryPool", "LeaseError", "MemoryLease", "aligned_bytes"]

logger = logging.getLogger(__name__)


class HostMemoryPool:
    """Host memory with a fixed byte budget, carved into leased allocations.

    Args:
        budget_bytes: Most bytes of host memory the pool ever holds (slabs included).
        pin: Page-lock the slabs (fast DMA to/from a GPU) through ``backend.pinned_empty``. ``None`` pins iff the backend is a device's (not the CPU's).
        slab_bytes: Size of one shared slab. Allocations up to this size share slabs; larger
            ones get a slab of their own.
        prepin: Pin the whole budget ahead of need on a background thread (the default when
            pinning); ``False`` pins slabs only when an allocation needs one.
        backend: The device backend whose host memory the slabs are
            (:func:`lmcache.devices.host_backend` by default: CUDA when available, else a
            registered device's, else the CPU's).

    Raises:
        ValueError: ``budget_bytes < 0`` or ``slab_bytes <= 0``.
    """

    def __init__(
        self,
        budget_bytes: int,
        *,
        pin: bool | None = None,
        slab_bytes: int = 256 << 20,
        prepin: bool | None = None,
        backend: DeviceBackend | None = None,
    ) -> None:
        if budget_bytes < 0:
            raise ValueError(f"HostMemoryPool budget_bytes must be >= 0, found {budget_bytes}")
        if slab_bytes <= 0:
            raise ValueError(f"HostMemoryPool slab_bytes must be > 0, found {slab_bytes}")
        self._budget = int(budget_bytes)
        self._slab_bytes = aligned_bytes(int(slab_bytes))
        if backend is None:
            backend = host_backend() if pin is None or pin else get_backend("cpu")
        self._backend = backend
        self._pin = backend.device_type != "cpu" if pin is None else bool(pin)
        self._lock = threading.Lock()
        self._slabs: list[Slab] = []  # shared slabs, in creation order
        self._dedicated = 0  # bytes in dedicated slabs
        self._used = 0  # bytes in live allocations (aligned sizes)
        self._prepinned = threading.Event()
        if self._pin and (prepin is None or prepin) and self._budget > 0:
            threading.Thread(target=self._prepin, name="lmcache-prepin", daemon=True).start()
        else:
            self._prepinned.set()

    def _prepin(self) -> None:
        """Pin shared slabs until the budget is reserved (background thread)."""
        try:
            while True:
                with self._lock:
                    room = (self._budget - self._reserved()) // ALIGNMENT * ALIGNMENT
                size = min(self._slab_bytes, room)
                if size < ALIGNMENT:
                    return
                slab = self._new_slab(size, dedicated=False)  # the slow part, outside the lock
                if slab is None:
                    return
                with self._lock:
                    if self._budget - self._reserved() < size:
                        return  # allocations took the room meanwhile; drop this slab
                    self._slabs.append(slab)
        finally:
            self._prepinned.set()

    def wait_prepinned(self, timeout: float | None = None) -> bool:
        """Block until the background thread has pinned the budget (at once for pageable or
        lazily pinned pools).

        Returns:
            ``False`` when ``timeout`` seconds passed first.
        """
        return self._prepinned.wait(timeout)

    @property
    def budget_bytes(self) -> int:
        """The byte budget."""
        return self._budget

    @property
    def used_bytes(self) -> int:
        """Bytes in live allocations (each rounded up to :data:`ALIGNMENT`)."""
        with self._lock:
            return self._used

    @property
    def free_bytes(self) -> int:
        """``budget_bytes - used_bytes`` (may be fragmented across slabs)."""
        with self._lock:
            return self._budget - self._used

    @property
    def reserved_bytes(self) -> int:
        """Bytes of host memory the pool's slabs hold now (at most ``budget_bytes``)."""
        with self._lock:
            return self._reserved()

    @property
    def pinned(self) -> bool:
        """Whether slabs are page-locked."""
        return self._pin

    def _reserved(self) -> int:
        return sum(s.size for s in self._slabs) + self._dedicated

    @contextlib.contextmanager
    def lease_counts(self) -> Iterator[Callable[[MemoryLease], int]]:
        """A reader of :attr:`MemoryLease.ref_count` for many leases of this pool under one
        acquisition of the pool's lock (no other call into the pool inside the block)."""
        with self._lock:
            yield lease_refs

    def allocate(self, shape: Sequence[int], dtype: torch.dtype) -> MemoryLease | None:
        """Lease a host tensor of ``shape`` and ``dtype``.

        Returns:
            A lease whose :attr:`MemoryLease.tensor` has the requested shape and dtype (its
            contents are undefined), or ``None`` when the budget cannot hold it right now. Never
            blocks waiting for memory.

        Raises:
            ValueError: a negative dimension.
        """
        leases = self.allocate_many(shape, dtype, 1)
        return leases[0] if leases else None

    def allocate_many(
        self, shape: Sequence[int], dtype: torch.dtype, count: int
    ) -> list[MemoryLease]:
        """Up to ``count`` leases of ``shape`` and ``dtype`` (like :meth:`allocate` each), in one
        pass: one lock, and pieces carved back to back where a free range holds several (so
        their copies can merge).

        Returns:
            The leases, fewer than ``count`` (possibly none) when the budget cannot hold more
            right now. Never blocks waiting for memory.

        Raises:
            ValueError: a negative dimension or count.
        """
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape) or count < 0:
            raise ValueError(
                f"HostMemoryPool.allocate_many: negative dimension in shape {shape} or count "
                f"{count}"
            )
        nbytes = math.prod(shape) * dtype.itemsize
        size = aligned_bytes(nbytes)
        out: list[MemoryLease] = []
        # Engines call us under torch.inference_mode(); chunk views made there could not be
        # written outside it, so they are made as normal tensors.
        with torch.inference_mode(False), self._lock:
            while len(out) < count and size <= self._budget - self._used:
                want = min(count - len(out), (self._budget - self._used) // size)
                run = self._place(size, want)
                if run is None:
                    break
                slab, offset, k = run
                self._used += k * size
                region = slab.tensor[offset : offset + k * size].view(k, size)[:, :nbytes]
                views = region.view(dtype).view(k, *shape).unbind(0) if nbytes else None
                for j in range(k):
                    view = views[j] if views is not None else region[j].view(dtype).view(shape)
                    out.append(MemoryLease(self, Allocation(slab, offset + j * size, size, view)))
        return out

    def _place(self, size: int, want: int) -> tuple[Slab, int, int] | None:
        """Find or make room for up to ``want`` back-to-back pieces of ``size`` bytes: ``(slab,
        offset, pieces)`` (at least one piece), or ``None``; caller holds the lock."""
        if size > self._slab_bytes:
            if not self._make_room(size):
                return None
            slab = self._new_slab(size, dedicated=True)
            if slab is None:
                return None
            self._dedicated += size
            return slab, 0, 1
        for slab in self._slabs:
            got = slab.take_run(size, want)
            if got is not None:
                return slab, got[0], got[1]
        room = self._budget - self._reserved()
        if room < size:
            if not self._make_room(size):
                return None
            room = self._budget - self._reserved()
        slab = self._new_slab(min(self._slab_bytes, room // ALIGNMENT * ALIGNMENT), dedicated=False)
        if slab is None:
            return None
        self._slabs.append(slab)
        got = slab.take_run(size, want)
        assert got is not None and got[0] == 0
        return slab, 0, got[1]

    def _make_room(self, size: int) -> bool:
        """Drop empty shared slabs until ``size`` more bytes fit in the budget."""
        for slab in [s for s in self._slabs if s.empty]:
            if self._budget - self._reserved() >= size:
                break
            self._slabs.remove(slab)
        return self._budget - self._reserved() >= size

    def _new_slab(self, size: int, *, dedicated: bool) -> Slab | None:
        try:
            with torch.inference_mode(False):  # a normal tensor even if the engine is in it
                if self._pin:
                    tensor = self._backend.pinned_empty(size)
                else:
                    tensor = torch.empty(size, dtype=torch.uint8)
        except (RuntimeError, MemoryError) as exc:
            logger.warning(
                "HostMemoryPool could not allocate a %d-byte %s host slab (%s); the allocation "
                "is treated as out of memory. Lower the budget (max_local_cpu_size) or, if "
                "pinning fails, construct the pool with pin=False.",
                size,
                "pinned" if self._pin else "pageable",
                exc,
            )
            return None
        return Slab(tensor, size, dedicated)

    def _free(self, alloc: Allocation) -> None:
        """Return an allocation's bytes; caller holds the lock."""
        self._used -= alloc.size
        if alloc.slab.dedicated:
            self._dedicated -= alloc.slab.size
        else:
            alloc.slab.give_back(alloc.offset, alloc.size)

    def __repr__(self) -> str:
        return (
            f"HostMemoryPool(budget_bytes={self._budget}, used_bytes={self._used}, "
            f"pinned={self._pin}, slabs={len(self._slabs)})"
        )
