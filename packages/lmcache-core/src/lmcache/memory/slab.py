# SPDX-License-Identifier: Apache-2.0
"""How a host memory pool carves allocations out of its slabs.

A slab is one host tensor ``uint8 [size]`` with the free ranges of
:class:`~lmcache.memory.free_ranges.FreeRanges`.
Allocations are first fit, several pieces of one size back to back where a range holds them.
Every piece starts at a multiple of :data:`ALIGNMENT` bytes.
Freed ranges merge with their neighbours.
"""

from __future__ import annotations

import torch

from lmcache.memory.free_ranges import ALIGNMENT, FreeRanges, aligned_bytes

__all__ = ["ALIGNMENT", "Slab", "aligned_bytes"]


class Slab(FreeRanges):
    """One host tensor ``uint8 [size]`` and its free ranges ``(offset, length)``, sorted.

    A dedicated slab holds one allocation that is all of it, so it starts with no free range.
    """

    __slots__ = ("dedicated", "tensor")

    def __init__(self, tensor: torch.Tensor, size: int, dedicated: bool) -> None:
        super().__init__(size, taken=dedicated)
        self.tensor = tensor
        self.dedicated = dedicated

    @property
    def empty(self) -> bool:
        """Whether nothing is carved out of it."""
        return self.untouched
