# SPDX-License-Identifier: Apache-2.0
"""The node cache owner's state: blocks of the arena, chunk entries, leases, eviction order.

A *block* is a range of the arena leased to one or more sessions (engine processes). A block is
*writing* from its :meth:`NodeIndex.alloc` until its writer commits it under a key, then *ready*:
an entry that lookups see. Only ready entries are ever handed out, so bytes a writer had not
finished (it died, or its owner restarted) are never read. A block goes back to the free list
when it is neither an entry nor leased by any session.

Eviction mirrors :class:`~lmcache.tiers.CPUTier`: entries nobody leases, orphans first, then
least recently used with a chain's tail before its head, never the ``protect`` keys
(:class:`~lmcache.tiers.prefix_lru.PrefixLRU`, shared by every engine of the node).

Single-threaded: the owner's event loop is its only caller. Imports no torch, so an owner starts
in a fraction of a second and stays small.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Container, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

__all__ = ["ALIGNMENT", "Block", "Entry", "NodeIndex", "aligned", "chunk_nbytes"]


def _stdlib_only(name: str) -> ModuleType:
    """The module ``name`` of ``lmcache``, one that imports only the standard library, without
    importing its package (``lmcache.memory`` and ``lmcache.tiers`` import torch)."""
    loaded = sys.modules.get(name)
    if loaded is None:
        path = Path(__file__).resolve().parent.parent.joinpath(*name.split(".")[1:])
        private = "lmcache.node._" + name.rpartition(".")[2]
        spec = importlib.util.spec_from_file_location(private, path.with_suffix(".py"))
        assert spec is not None and spec.loader is not None
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[private] = loaded  # as an import would: dataclasses look their module up
        spec.loader.exec_module(loaded)
    return loaded


if TYPE_CHECKING:
    from lmcache.memory import free_ranges as _free_ranges
    from lmcache.tiers import prefix_lru as _prefix_lru
else:
    _free_ranges = _stdlib_only("lmcache.memory.free_ranges")
    _prefix_lru = _stdlib_only("lmcache.tiers.prefix_lru")

#: Blocks start at multiples of this many bytes (the per-process pool's alignment).
ALIGNMENT = _free_ranges.ALIGNMENT

#: ``nbytes`` rounded up to :data:`ALIGNMENT`, at least one unit.
aligned = _free_ranges.aligned_bytes


@dataclass(eq=False)
class Block:
    """A leased or stored range of the arena."""

    id: int
    offset: int
    size: int  # aligned bytes taken from the arena
    leases: int = 0  # over all sessions
    key: bytes | None = None  # set once committed (ready)


@dataclass(eq=False)
class Entry:
    """A ready chunk: its block and what a reader needs to view and verify it."""

    block: Block
    nbytes: int
    shape: list[int]
    dtype: str
    checksum: int | None
    device_sum: int | None
    owner: bytes


@dataclass(eq=False)
class Leases:
    """One session's lease counts by block id."""

    counts: dict[int, int] = field(default_factory=dict)


class NodeIndex:
    """Entries, blocks and leases over an arena of ``data_bytes`` (see the module docstring)."""

    def __init__(self, data_bytes: int) -> None:
        self.data_bytes = int(data_bytes)
        self.free = _free_ranges.FreeRanges(self.data_bytes)
        self.used = 0
        self.blocks: dict[int, Block] = {}
        self.entries: dict[bytes, Entry] = {}
        self.order: _prefix_lru.PrefixLRU[bytes] = _prefix_lru.PrefixLRU()
        self.evicted = 0
        self._next_id = 1

    # ------------------------------------------------------------------ leases

    def lease(self, leases: Leases, block: Block, n: int = 1) -> None:
        block.leases += n
        leases.counts[block.id] = leases.counts.get(block.id, 0) + n

    def release(self, leases: Leases, block_id: int, n: int = 1) -> None:
        """Drop ``n`` of the session's leases on ``block_id`` (unknown ids are ignored)."""
        have = leases.counts.get(block_id, 0)
        n = min(n, have)
        if n <= 0:
            return
        if have == n:
            del leases.counts[block_id]
        else:
            leases.counts[block_id] = have - n
        block = self.blocks[block_id]
        block.leases -= n
        self._maybe_free(block)

    def release_all(self, leases: Leases) -> int:
        """Drop every lease of a session (it ended); returns how many blocks it held."""
        held = list(leases.counts.items())
        for block_id, n in held:
            self.release(leases, block_id, n)
        return len(held)

    def reconcile(self, leases: Leases, holds: Iterable[tuple[int, int]]) -> None:
        """Set a reconnecting session's counts to what the client says it holds (a reply lost
        with a timed-out call leaves leases the client never saw)."""
        want = {b: n for b, n in holds if n > 0}
        for block_id, have in list(leases.counts.items()):
            keep = min(have, want.get(block_id, 0))
            if keep < have:
                self.release(leases, block_id, have - keep)

    def _maybe_free(self, block: Block) -> None:
        if block.leases == 0 and block.key is None:
            del self.blocks[block.id]
            self.used -= block.size
            self.free.give_back(block.offset, block.size)

    # ------------------------------------------------------------------ allocation

    def alloc(
        self, leases: Leases, nbytes: int, count: int, protect: Container[bytes]
    ) -> tuple[list[Block], int]:
        """Up to ``count`` blocks of ``nbytes``, leased to the session, evicting unleased
        entries (not in ``protect``) as needed; returns the blocks and how many entries went."""
        size = aligned(nbytes)
        out: list[Block] = []
        evicted = 0
        if size > self.data_bytes:
            return out, 0
        short = count * size - (self.data_bytes - self.used)
        if short > 0:
            evicted += self._evict(short, protect)
        while len(out) < count:
            got = self.free.take_run(size, count - len(out))
            if got is None:
                gone = self._evict((count - len(out)) * size, protect)
                if not gone:
                    break
                evicted += gone
                continue
            offset, k = got
            for j in range(k):
                block = Block(self._next_id, offset + j * size, size)
                self._next_id += 1
                self.blocks[block.id] = block
                self.lease(leases, block)
                out.append(block)
            self.used += k * size
        self.evicted += evicted
        return out, evicted

    def _evict(self, nbytes: int, protect: Container[bytes]) -> int:
        entries = self.entries

        def size_of(key: bytes) -> int | None:
            block = entries[key].block
            return block.size if block.leases == 0 else None

        victims = self.order.victims(nbytes, size_of, protect)
        for key in victims:
            self._drop(key)
        return len(victims)

    # ------------------------------------------------------------------ entries

    def commit(
        self, leases: Leases, block_id: int, key: bytes, parent: bytes | None, entry: Entry
    ) -> str | None:
        """Publish a block the session holds and has not committed as the chunk ``key`` (an
        entry already under ``key`` is replaced); returns why not, or ``None``."""
        block = self.blocks.get(block_id)
        if block is None or leases.counts.get(block_id, 0) <= 0:
            return f"block {block_id} is not leased by this session"
        if block.key is not None:
            return f"block {block_id} is committed already"
        if entry.nbytes > block.size or entry.block is not block:
            return f"{entry.nbytes} bytes do not fit block {block_id} of {block.size}"
        if key in self.entries:
            self._drop(key)
        block.key = key
        self.entries[key] = entry
        self.order.add(key, parent)
        return None

    def block(self, block_id: int) -> Block | None:
        return self.blocks.get(block_id)

    def get(self, leases: Leases, key: bytes) -> Entry | None:
        """Lease the ready chunk ``key`` to the session and mark it used."""
        entry = self.entries.get(key)
        if entry is None:
            return None
        self.order.touch(key)
        self.lease(leases, entry.block)
        return entry

    def missing(self, keys: Iterable[bytes]) -> list[int]:
        entries = self.entries
        return [i for i, key in enumerate(keys) if key not in entries]

    def _drop(self, key: bytes) -> Entry | None:
        entry = self.entries.pop(key, None)
        if entry is None:
            return None
        self.order.discard(key)
        entry.block.key = None
        self._maybe_free(entry.block)
        return entry

    def remove(self, key: bytes, block_id: int | None = None) -> bool:
        """Drop the entry ``key`` (only if it is in ``block_id``, when given)."""
        entry = self.entries.get(key)
        if entry is None or (block_id is not None and entry.block.id != block_id):
            return False
        self._drop(key)
        return True

    def clear(self, owner: bytes | None) -> int:
        keys = [k for k, e in self.entries.items() if owner is None or e.owner == owner]
        for key in keys:
            self._drop(key)
        return len(keys)

    def leased_blocks(self) -> int:
        return sum(1 for b in self.blocks.values() if b.leases > 0)


_ITEMSIZE = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "int16": 2,
    "uint16": 2,
    "float16": 2,
    "bfloat16": 2,
    "int32": 4,
    "uint32": 4,
    "float32": 4,
    "int64": 8,
    "uint64": 8,
    "float64": 8,
}
"""Bytes per element of the dtypes a chunk may have (torch names without ``torch.``)."""


def chunk_nbytes(shape: list[int], dtype: str) -> int | None:
    """Bytes of a chunk of ``shape`` and ``dtype`` (a torch dtype name), or ``None`` for a dtype
    chunks do not have."""
    size = _ITEMSIZE.get(dtype)
    if size is None:
        return None
    n = size
    for d in shape:
        n *= d
    return n
