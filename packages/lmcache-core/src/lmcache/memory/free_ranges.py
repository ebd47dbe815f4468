# SPDX-License-Identifier: Apache-2.0
"""The free byte ranges of one buffer: first fit, merged with their neighbours when freed.

Both allocators of host memory use it: a pool's :class:`~lmcache.memory.slab.Slab` and the node
cache owner's arena (:class:`~lmcache.node.index.NodeIndex`).
Callers take and give back sizes from :func:`aligned_bytes`.
So every piece starts at a multiple of :data:`ALIGNMENT` bytes.

Imports only the standard library.
The node cache owner loads this file without torch, so it must stay that way.
"""

from __future__ import annotations

__all__ = ["ALIGNMENT", "FreeRanges", "aligned_bytes"]

#: Every allocation starts at a multiple of this many bytes within its buffer.
ALIGNMENT = 256


def aligned_bytes(nbytes: int) -> int:
    """Bytes an allocation of ``nbytes`` takes: ``nbytes`` rounded up to a multiple of
    :data:`ALIGNMENT`, at least one unit."""
    return max(ALIGNMENT, (nbytes + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT)


class FreeRanges:
    """The free ranges ``(offset, length)`` of a buffer of ``size`` bytes, sorted by offset.

    Args:
        size: Bytes of the buffer.
        taken: Start with all of it taken (no free ranges) instead of all free.
    """

    __slots__ = ("free", "size")

    def __init__(self, size: int, *, taken: bool = False) -> None:
        self.size = size
        self.free: list[tuple[int, int]] = [] if taken or size <= 0 else [(0, size)]

    @property
    def untouched(self) -> bool:
        """Whether all of the buffer is free, as one range."""
        return self.free == [(0, self.size)]

    def take_run(self, size: int, count: int) -> tuple[int, int] | None:
        """First fit for up to ``count`` back-to-back pieces of ``size`` bytes: ``(offset,
        pieces)`` carved from the first free range that holds at least one, or ``None``."""
        for i, (offset, length) in enumerate(self.free):
            if length >= size:
                k = min(count, length // size)
                if length == k * size:
                    del self.free[i]
                else:
                    self.free[i] = (offset + k * size, length - k * size)
                return offset, k
        return None

    def give_back(self, offset: int, size: int) -> None:
        """Return ``[offset, offset + size)`` to the free ranges, merging adjacent ranges."""
        free = self.free
        lo, hi = 0, len(free)
        while lo < hi:  # bisect on the offsets
            mid = (lo + hi) // 2
            if free[mid][0] < offset:
                lo = mid + 1
            else:
                hi = mid
        start, end = offset, offset + size
        if lo < len(free) and free[lo][0] == end:  # merge with the next range
            end = free[lo][0] + free[lo][1]
            del free[lo]
        if lo > 0 and free[lo - 1][0] + free[lo - 1][1] == start:  # merge with the previous one
            start = free[lo - 1][0]
            lo -= 1
            del free[lo]
        free.insert(lo, (start, end - start))
