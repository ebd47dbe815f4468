# SPDX-License-Identifier: Apache-2.0
"""The eviction order of a tier whose entries form key chains: prefixes stay usable.

Chunk ``i``'s key hashes chunks ``0..i``, and a lookup stops at its first missing chunk, so a
chunk whose predecessor (its *parent*) is gone from a tier is worthless there: an *orphan*.
:class:`PrefixLRU` keeps the recency order of a tier's entries together with each entry's
parent (``None`` for a chain's first chunk, or when unknown) and picks victims so that what
remains of every prompt is a prefix:

1. **Orphans first**, least recently used first (an index of them is kept: no scan).
2. **Then least recently used first**, where a run of one chain is touched tail first
   (:meth:`PrefixLRU.touch_chain`), so a prompt's tail is older than its head and goes first.
3. When an entry is chosen, its present descendants are chosen next (they become orphans).
4. Keys in ``protect`` are never chosen: a store passes the prefix it extends (its chain up to
   the chunks it adds, :meth:`PrefixLRU.ancestors`), so it never evicts that prefix to make
   room (it stores fewer chunks instead).

Children are indexed by parent key (present or not), so an entry that goes turns its children
into orphans, and a parent that arrives (again) adopts them, both in time proportional to the
children. Costs: touch, add and remove O(1) (amortised O(log n) for orphans); a victim search
O(victims + entries skipped because they are leased or protected).

Not thread-safe: the tier that owns one guards it with its lock.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Container, Generator, Hashable, Iterable, Iterator
from typing import Generic, TypeVar

__all__ = ["PrefixLRU"]

K = TypeVar("K", bound=Hashable)


class PrefixLRU(Generic[K]):
    """Recency order, parent links and orphans of a tier's entries (see the module docstring).

    Iteration yields the keys least recently used first.
    """

    def __init__(self) -> None:
        self._order: OrderedDict[K, int] = OrderedDict()  # key -> tick of its last use
        self._parent: dict[K, K] = {}  # entries whose parent is known
        self._children: dict[K, dict[K, None]] = {}  # parent key -> present children
        self._orphan_at: dict[int, K] = {}  # the current tick of each orphan -> the orphan
        self._heap: list[int] = []  # orphans' ticks, oldest first (stale ticks skipped)
        self._tick = 0

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __iter__(self) -> Iterator[K]:
        return iter(self._order)

    @property
    def num_orphans(self) -> int:
        """How many entries are orphans (their parent is known and absent)."""
        return len(self._orphan_at)

    def is_orphan(self, key: K) -> bool:
        """Whether ``key`` is present and its parent is known and absent."""
        tick = self._order.get(key)
        return tick is not None and tick in self._orphan_at

    def parent(self, key: K) -> K | None:
        """The parent recorded for ``key`` (``None``: a chain's head, unknown, or absent)."""
        return self._parent.get(key)

    def ancestors(self, parent: K | None) -> set[K]:
        """``parent`` and its recorded ancestors, as far as they are present: the prefix that
        storing a child of ``parent`` extends (a ``protect`` set for :meth:`victims`)."""
        out: set[K] = set()
        while parent is not None and parent in self._order and parent not in out:
            out.add(parent)
            parent = self._parent.get(parent)
        return out

    # ------------------------------------------------------------------ updates

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def _push(self, tick: int, key: K) -> None:
        self._orphan_at[tick] = key
        heapq.heappush(self._heap, tick)
        if len(self._heap) > 2 * len(self._orphan_at) + 64:  # drop stale ticks
            self._heap = sorted(self._orphan_at)

    def add(self, key: K, parent: K | None = None) -> None:
        """Insert ``key`` (or refresh it) as the most recently used, with ``parent``.

        It is an orphan when ``parent`` is given and absent; present entries whose parent is
        ``key`` stop being orphans.
        """
        if key in self._order:
            self._unlink(key)
        tick = self._next_tick()
        self._order[key] = tick
        self._order.move_to_end(key)
        if parent is not None:
            self._parent[key] = parent
            self._children.setdefault(parent, {})[key] = None
            if parent not in self._order:
                self._push(tick, key)
        for child in self._children.get(key, ()):
            child_tick = self._order[child]
            self._orphan_at.pop(child_tick, None)

    def _unlink(self, key: K) -> None:
        """Forget ``key``'s parent link and orphan mark (it stays in the order)."""
        self._orphan_at.pop(self._order[key], None)
        parent = self._parent.pop(key, None)
        if parent is not None:
            siblings = self._children[parent]
            del siblings[key]
            if not siblings:
                del self._children[parent]

    def discard(self, key: K) -> bool:
        """Remove ``key``; its present children become orphans. Returns whether it was there."""
        if key not in self._order:
            return False
        self._unlink(key)
        del self._order[key]
        for child in self._children.get(key, ()):
            self._push(self._order[child], child)
        return True

    def touch(self, key: K) -> bool:
        """Mark ``key`` the most recently used; returns whether it is present."""
        old = self._order.get(key)
        if old is None:
            return False
        tick = self._next_tick()
        self._order[key] = tick
        self._order.move_to_end(key)
        if self._orphan_at.pop(old, None) is not None:
            self._push(tick, key)
        return True

    def touch_chain(self, keys: Iterable[K]) -> int:
        """Mark a run of one chain used, ``keys[0]`` the most recent (touched in reverse).

        Each later chunk ends up less recently used than the ones before it, so the run's tail
        goes before its head. Absent keys are skipped.

        Returns:
            How many of ``keys`` are present (and were touched).
        """
        # touch() inlined: a lookup touches every chunk of its hit, in one call
        order, orphan_at = self._order, self._orphan_at
        touched = 0
        for key in reversed(keys if isinstance(keys, list) else list(keys)):
            old = order.get(key)
            if old is None:
                continue
            self._tick += 1
            order[key] = self._tick
            order.move_to_end(key)
            if orphan_at.pop(old, None) is not None:
                self._push(self._tick, key)
            touched += 1
        return touched

    def clear(self) -> None:
        """Forget every entry."""
        self._order.clear()
        self._parent.clear()
        self._children.clear()
        self._orphan_at.clear()
        self._heap.clear()

    # ------------------------------------------------------------------ victims

    def _orphans_oldest_first(self) -> Generator[K, None, None]:
        """Orphans, least recently used first (a heap walk; it leaves the heap as it was)."""
        popped: list[int] = []
        try:
            while self._heap:
                tick = heapq.heappop(self._heap)
                key = self._orphan_at.get(tick)
                if key is None:
                    continue  # stale: touched, adopted or removed since
                popped.append(tick)
                yield key
        finally:
            for tick in popped:
                heapq.heappush(self._heap, tick)

    def victims(
        self,
        nbytes: int,
        size_of: Callable[[K], int | None],
        protect: Container[K] = frozenset(),
    ) -> list[K]:
        """Keys to evict, in eviction order, until they free at least ``nbytes``.

        Nothing is removed here: the caller removes the returned keys (:meth:`discard`).

        Args:
            nbytes: Bytes to free; ``<= 0`` chooses nothing.
            size_of: Bytes evicting a key frees, or ``None`` when it cannot be evicted now
                (e.g. someone leases it).
            protect: Keys never chosen (the prefix a store extends).

        Returns:
            The keys, orphans first, then least recently used first, each followed by its
            present descendants; all that can be chosen when together they free less.
        """
        out: list[K] = []
        taken: set[K] = set()
        freed = 0

        def take(key: K) -> None:
            nonlocal freed
            pending = [key]
            while pending and freed < nbytes:
                k = pending.pop()
                if k in taken or k in protect:
                    continue
                size = size_of(k)
                if size is None:
                    continue
                out.append(k)
                taken.add(k)
                freed += size
                pending.extend(self._children.get(k, ()))  # orphans once k goes

        if nbytes <= 0:
            return out
        orphans = self._orphans_oldest_first()
        try:
            for key in orphans:
                if freed >= nbytes:
                    break
                take(key)
        finally:
            orphans.close()  # restores the heap
        for key in self._order:
            if freed >= nbytes:
                break
            take(key)
        return out
