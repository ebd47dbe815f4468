# SPDX-License-Identifier: Apache-2.0
""":class:`~lmcache.memory.free_ranges.FreeRanges` against a brute-force bitmap allocator, and
its two users: a host pool's slab and the node cache owner's index (which must load no torch)."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from lmcache.memory.free_ranges import ALIGNMENT, FreeRanges, aligned_bytes


class Bitmap:
    """The reference: one flag per :data:`ALIGNMENT` unit, free ranges read off by a scan."""

    def __init__(self, units: int) -> None:
        self.taken = [False] * units

    def ranges(self) -> list[tuple[int, int]]:
        """Maximal runs of free units as ``(offset, length)`` in bytes, by offset."""
        out: list[tuple[int, int]] = []
        start = None
        for i, taken in enumerate([*self.taken, True]):
            if not taken and start is None:
                start = i
            elif taken and start is not None:
                out.append((start * ALIGNMENT, (i - start) * ALIGNMENT))
                start = None
        return out

    def take_run(self, size: int, count: int) -> tuple[int, int] | None:
        """The first maximal free run that holds one piece gives ``min(count, fits)`` pieces."""
        for offset, length in self.ranges():
            if length >= size:
                k = min(count, length // size)
                first = offset // ALIGNMENT
                for u in range(first, first + k * size // ALIGNMENT):
                    self.taken[u] = True
                return offset, k
        return None

    def give_back(self, offset: int, size: int) -> None:
        for u in range(offset // ALIGNMENT, (offset + size) // ALIGNMENT):
            assert self.taken[u], "freed twice"
            self.taken[u] = False


@pytest.mark.parametrize("seed", range(20))
def test_random_sequences_match_a_bitmap_allocator(seed: int) -> None:
    rng = random.Random(seed)
    units = rng.choice([1, 7, 64, 257])
    ranges, ref = FreeRanges(units * ALIGNMENT), Bitmap(units)
    live: list[tuple[int, int]] = []  # (offset, size) of each piece handed out
    for _ in range(600):
        if live and rng.random() < 0.45:
            offset, size = live.pop(rng.randrange(len(live)))
            ranges.give_back(offset, size)
            ref.give_back(offset, size)
        else:
            size = aligned_bytes(rng.randint(0, 6 * ALIGNMENT))
            count = rng.randint(1, 5)
            got = ranges.take_run(size, count)
            assert got == ref.take_run(size, count)
            if got is not None:
                assert got[0] % ALIGNMENT == 0 and 1 <= got[1] <= count
                live += [(got[0] + j * size, size) for j in range(got[1])]
        assert ranges.free == ref.ranges()  # sorted, and neighbours always merged
        assert ranges.untouched == (not live)
    for offset, size in live:
        ranges.give_back(offset, size)
    assert ranges.free == [(0, units * ALIGNMENT)] and ranges.untouched


def test_aligned_bytes() -> None:
    assert [aligned_bytes(n) for n in (0, 1, 255, 256, 257, 512, 513)] == [
        256,
        256,
        256,
        256,
        512,
        512,
        768,
    ]


def test_first_fit_takes_the_lowest_range_that_holds_one_piece() -> None:
    ranges = FreeRanges(10 * ALIGNMENT)
    a = ALIGNMENT
    assert ranges.take_run(a, 10) == (0, 10)
    assert ranges.free == [] and not ranges.untouched
    assert ranges.take_run(a, 1) is None  # exhausted
    for offset in (1, 4, 5, 7, 8, 9):
        ranges.give_back(offset * a, a)
    assert ranges.free == [(a, a), (4 * a, 2 * a), (7 * a, 3 * a)]
    assert ranges.take_run(2 * a, 5) == (4 * a, 1)  # skips the 1-unit hole, takes one piece
    assert ranges.take_run(2 * a, 5) == (7 * a, 1)  # the rest of that range is too short now
    assert ranges.free == [(a, a), (9 * a, a)]
    assert ranges.take_run(3 * a, 1) is None


@pytest.mark.parametrize("order", [(0, 1, 2), (0, 2, 1), (1, 0, 2), (2, 1, 0), (1, 2, 0)])
def test_freed_pieces_merge_with_both_neighbours(order: tuple[int, int, int]) -> None:
    a = ALIGNMENT
    ranges = FreeRanges(5 * a)
    assert ranges.take_run(a, 5) == (0, 5)
    for i in order:
        ranges.give_back((1 + i) * a, a)
    assert ranges.free == [(a, 3 * a)]
    ranges.give_back(0, a)
    ranges.give_back(4 * a, a)
    assert ranges.free == [(0, 5 * a)] and ranges.untouched


def test_taken_and_empty_buffers() -> None:
    taken = FreeRanges(4 * ALIGNMENT, taken=True)
    assert taken.free == [] and taken.take_run(ALIGNMENT, 1) is None and not taken.untouched
    taken.give_back(0, 4 * ALIGNMENT)
    assert taken.untouched
    assert FreeRanges(0).free == [] and FreeRanges(0).take_run(ALIGNMENT, 1) is None


def test_slab_and_node_index_share_it() -> None:
    import torch

    from lmcache.memory.slab import ALIGNMENT as SLAB_ALIGNMENT
    from lmcache.memory.slab import Slab
    from lmcache.node import index

    assert SLAB_ALIGNMENT == index.ALIGNMENT == ALIGNMENT
    assert index.aligned(ALIGNMENT + 1) == aligned_bytes(ALIGNMENT + 1)
    slab = Slab(torch.empty(4 * ALIGNMENT, dtype=torch.uint8), 4 * ALIGNMENT, False)
    assert slab.empty and slab.take_run(ALIGNMENT, 3) == (0, 3) and not slab.empty
    slab.give_back(ALIGNMENT, ALIGNMENT)
    assert slab.free == [(ALIGNMENT, ALIGNMENT), (3 * ALIGNMENT, ALIGNMENT)]
    dedicated = Slab(torch.empty(ALIGNMENT, dtype=torch.uint8), ALIGNMENT, True)
    assert dedicated.free == [] and not dedicated.empty
    node = index.NodeIndex(5 * ALIGNMENT)
    blocks, _ = node.alloc(index.Leases(), ALIGNMENT + 1, 3, ())  # 2 units each: 2 fit
    assert [(b.offset, b.size) for b in blocks] == [
        (0, 2 * ALIGNMENT),
        (2 * ALIGNMENT, 2 * ALIGNMENT),
    ]
    assert node.free.free == [(4 * ALIGNMENT, ALIGNMENT)]


_OWNER = """
import json, sys
import lmcache.node.__main__
from lmcache.node.index import Leases, NodeIndex
node, leases = NodeIndex(1 << 20), Leases()
blocks, _ = node.alloc(leases, 1000, 8, ())
node.release_all(leases)
print(json.dumps({"torch": "torch" in sys.modules, "memory": "lmcache.memory" in sys.modules,
                  "whole": node.free.free == [(0, 1 << 20)], "got": len(blocks)}))
"""


def test_node_owner_allocates_without_torch() -> None:
    """The owner loads the free ranges module by path, not through ``lmcache.memory``."""
    out = subprocess.run(
        [sys.executable, "-c", _OWNER], capture_output=True, text=True, check=True, timeout=120
    )
    assert json.loads(out.stdout) == {"torch": False, "memory": False, "whole": True, "got": 8}
