# SPDX-License-Identifier: Apache-2.0
"""An engine's leases on arena bytes: allocations that name their block, the lease bookkeeping
of :class:`~lmcache.node.client.NodeClient` (:class:`ArenaLeases`), and the dtype names the wire
carries.

Every lease belongs to an *epoch*: the span in which the owner vouches for this process's blocks
(one owner generation, one session). A new epoch starts when the owner is replaced or forgets
the session; leases of older epochs are stale: their bytes stay mapped until released, their
commits and releases are never sent.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lmcache.devices import DeviceBackend
from lmcache.memory.lease import Allocation, MemoryLease
from lmcache.memory.slab import Slab
from lmcache.node import wire
from lmcache.node.arena import MappedArena, NodeCacheError, pin_in_background, unpin

__all__ = ["ArenaLeases", "NodeAllocation", "dtype_name", "dtype_of", "leading_alike"]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the name on the wire)."""
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype | None:
    """The torch dtype a wire name stands for, or ``None``."""
    found = getattr(torch, name, None)
    return found if isinstance(found, torch.dtype) else None


@dataclass(eq=False)
class NodeAllocation(Allocation):
    """An :class:`~lmcache.memory.lease.Allocation` of arena bytes: its block and lineage."""

    block: int = 0
    epoch: int = 0
    arena: MappedArena | None = None


def leading_alike(chunks: list[wire.GetReply]) -> int:
    """How many leading records share the first one's shape and (known) dtype, each of the size
    they imply: those are leased in one pass; the rest are released."""
    if not chunks or (dtype := dtype_of(chunks[0].dtype)) is None:
        return 0
    head = chunks[0]
    nbytes = dtype.itemsize * math.prod(head.shape)
    n = 0
    for record in chunks:
        if record.shape != head.shape or record.dtype != head.dtype or record.nbytes != nbytes:
            break
        n += 1
    return n


class ArenaLeases:
    """The lease side of a node cache client: a :class:`~lmcache.memory.lease.LeaseOwner` over
    the current arena, its epoch, the blocks this process holds and the messages owed to the
    owner (commits, then releases: a block is always committed before it is released).

    Args:
        backend: Page-locks each arena mapping when it is a device's (``None``: never).
    """

    def __init__(self, backend: DeviceBackend | None) -> None:
        self._backend = backend
        self._lock = threading.Lock()  # the LeaseOwner lock: counts, holds, queues, epoch
        self._arena: MappedArena | None = None
        self._slab: Slab | None = None
        self._epoch = 0
        self._holds: dict[int, int] = {}  # block -> live allocations of the current epoch
        self._pending: list[int] = []  # blocks to release (current epoch)
        self._outbox: list[bytes] = []  # one-way frames to send before them (commits)

    def _flush_soon(self) -> None:
        """Have the queued messages sent soon (the client sends them)."""

    def _take_queued(self) -> list[bytes]:
        """The frames owed to the owner, in order (commits, then releases); the queues empty."""
        with self._lock:
            out, pending = self._outbox, self._pending
            self._outbox, self._pending = [], []
        step = wire.MAX_KEYS
        out += [
            wire.encode(wire.Release(pending[i : i + step])) for i in range(0, len(pending), step)
        ]
        return out

    def _new_epoch(self) -> None:
        """Under ``_lock``: forget what this process held (the owner does not vouch for it)."""
        self._epoch += 1
        self._holds.clear()
        self._pending.clear()
        self._outbox.clear()

    def _adopt_arena(self, arena: MappedArena, data_bytes: int) -> None:
        """Make ``arena`` the current one (pinned in the background), starting a new epoch."""
        if self._backend is not None:
            pin_in_background(arena, self._backend)
        with self._lock:
            old, self._arena = self._arena, arena
            self._slab = Slab(arena.data, data_bytes, True)
            self._new_epoch()
            if old is not None:
                self._retire_if_unused(old)

    def _retire_if_unused(self, arena: MappedArena) -> None:
        """Under ``_lock``: unpin a previous generation's mapping nobody leases any more (the
        mapping goes with its last tensor)."""
        if arena is not self._arena and arena.live == 0 and self._backend is not None:
            unpin(arena, self._backend)

    def lease_blocks(
        self, blocks: Sequence[tuple[int, int]], shape: Sequence[int], dtype: torch.dtype
    ) -> list[MemoryLease]:
        """Leases viewing ``(block, offset)`` pairs of the current arena as ``shape``/``dtype``
        (the blocks the owner just leased to this session; call under the client's ``_io``)."""
        arena, slab = self._arena, self._slab
        assert arena is not None and slab is not None
        nbytes = math.prod(shape) * dtype.itemsize
        if any(offset + nbytes > arena.data.numel() for _, offset in blocks):
            raise NodeCacheError(
                f"node cache owner leased blocks {blocks} of {nbytes} bytes, beyond the "
                f"{arena.data.numel()}-byte arena"
            )
        views = arena.views([offset for _, offset in blocks], shape, dtype)
        out: list[MemoryLease] = []
        with self._lock:
            epoch, holds = self._epoch, self._holds
            for (block, offset), view in zip(blocks, views, strict=True):
                alloc = NodeAllocation(
                    slab, offset, nbytes, view, block=block, epoch=epoch, arena=arena
                )
                holds[block] = holds.get(block, 0) + 1
                out.append(MemoryLease(self, alloc))
            arena.live += len(out)
        return out

    def current_block(self, lease: MemoryLease) -> int | None:
        """The block of a lease from this client, if it belongs to the current epoch."""
        alloc = lease._alloc
        if not isinstance(alloc, NodeAllocation) or lease._pool is not self:
            return None
        with self._lock:
            return alloc.block if alloc.epoch == self._epoch else None

    def post(self, lease: MemoryLease, msg: wire.Commit) -> bool:
        """Queue ``msg`` (the commit of ``lease``'s block) if the block is of the current epoch;
        it goes out before any later request or release. Returns whether it was queued."""
        alloc = lease._alloc
        with self._lock:
            if not isinstance(alloc, NodeAllocation) or alloc.epoch != self._epoch:
                return False
            self._outbox.append(wire.encode(msg))
        self._flush_soon()
        return True

    def _free(self, alloc: Allocation) -> None:
        """The last lease of an allocation went (``_lock`` held): tell the owner."""
        assert isinstance(alloc, NodeAllocation) and alloc.arena is not None
        alloc.arena.live -= 1
        if alloc.epoch == self._epoch:
            left = self._holds.get(alloc.block, 0) - 1
            if left > 0:
                self._holds[alloc.block] = left
            else:
                self._holds.pop(alloc.block, None)
            self._pending.append(alloc.block)
        self._retire_if_unused(alloc.arena)
        # Sent by whoever holds the socket next, else by the flusher thread (we hold the lease
        # lock here, which sending takes).
        self._flush_soon()
