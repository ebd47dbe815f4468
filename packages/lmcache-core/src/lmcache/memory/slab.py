# SPDX-License-Identifier: Apache-2.0
"""How a host memory pool carves allocations out of its slabs.

A slab is one host tensor ``uint8 [size]`` with a sorted list of free byte ranges.
Allocations are first fit, several pieces of one size back to back where a range holds them.
Every piece starts at a multiple of :data:`ALIGNMENT` bytes.
Freed ranges merge with their neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["ALIGNMENT", "Slab", "aligned_bytes"]

#: Every allocation starts at a multiple of this many bytes within its slab.
ALIGNMENT = 256


def aligned_bytes(nbytes: int) -> int:
    """Bytes of the pool an allocation of ``nbytes`` takes (:attr:`MemoryLease.pool_bytes`):
    ``nbytes`` rounded up to a multiple of :data:`ALIGNMENT`, at least one unit."""
    return max(ALIGNMENT, (nbytes + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT)


@dataclass(eq=False)
class Slab:
    """One host tensor ``uint8 [size]`` and its free ranges ``(offset, length)``, sorted."""

    tensor: torch.Tensor
    size: int
    dedicated: bool
    free: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.dedicated:
            self.free = [(0, self.size)]

    @property
    def empty(self) -> bool:
        """Whether nothing is carved out of it."""
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
        """Return ``[offset, offset + size)`` to the free list, merging adjacent ranges."""
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
