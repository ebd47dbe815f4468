# SPDX-License-Identifier: Apache-2.0
"""The CPU tier: chunks kept in a :class:`~lmcache.memory.HostMemoryPool`, evicted so that
prefixes stay usable.

Each entry holds its own lease on the chunk's bytes and, optionally, an xxh3-64 checksum of those
bytes taken when the chunk was stored (:mod:`lmcache.tiers.checksum`). :meth:`CPUTier.get` verifies
the checksum before handing the chunk out: a mismatch is a miss (counted in
``metrics.checksum_failures``, the entry dropped), so a corrupted chunk is never loaded.
:meth:`CPUTier.get_many` does the same for a run of keys, its checksums taken in one batch.

Eviction happens only in :meth:`CPUTier.allocate` / :meth:`CPUTier.allocate_many`, and only of
entries that nobody but the tier leases: a chunk that a retrieve is copying, or that a caller
holds (a lease from :meth:`CPUTier.get`), stays. Chunk ``i``'s key hashes chunks ``0..i`` and a
lookup stops at its first missing chunk, so a chunk whose predecessor is gone is worthless. Each
entry records its *parent* (the previous chunk's key, given to :meth:`CPUTier.put`; ``None`` for
a chain's first chunk or when unknown), and victims are taken in this order
(:class:`~lmcache.tiers.prefix_lru.PrefixLRU`):

1. *Orphans* first, least recently used first: entries whose parent is known and gone.
2. Then least recently used first. :meth:`CPUTier.touch_many` marks a run of one key chain used
   tail first, so each chunk is less recent than the ones before it: a prompt's tail goes before
   its head, and what remains of a prompt is a prefix. An entry chosen takes its present
   descendants with it.
3. Keys in ``protect`` are never evicted: a store passes its own chain, so making room for the
   chunks it adds never evicts the prefix they extend (it gets fewer buffers instead and stores
   fewer chunks, head first).

Without this, a prompt larger than the tier, repeated, evicted its own head to store its tail and
hit a different number of tokens on every run.

One tier may be shared by the engines of a process (:func:`lmcache.tiers.process_cpu_tier`):
entries record an ``owner`` (the storing engine's fingerprint) so one engine can drop only its
own chunks, and :meth:`CPUTier.get` / :meth:`CPUTier.allocate` count checksum failures and
evictions into the metrics their caller passes.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lmcache.memory import HostMemoryPool, MemoryLease, aligned_bytes
from lmcache.tiers.checksum import (
    CHECKSUM_SLICE_BYTES,
    batch_checksums,
    tensor_checksum,
)
from lmcache.tiers.prefix_lru import PrefixLRU

if TYPE_CHECKING:
    from lmcache.metrics import LMCacheMetrics

__all__ = ["CHECKSUM_SLICE_BYTES", "CPUTier", "tensor_checksum"]

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Entry:
    lease: MemoryLease
    checksum: int | None
    owner: bytes


class CPUTier:
    """Chunks in host memory, keyed by chunk key, evicted inside the pool's budget in an order
    that keeps prefixes usable (orphans first, then LRU with a chain's tail before its head; see
    the module docstring).

    Thread-safe. Lock order: the tier's lock, then the pool's.

    Args:
        pool: The host pool chunks are allocated from.
        metrics: Counts ``evicted_chunks`` and ``checksum_failures`` of the calls that pass no
            ``metrics`` of their own.
    """

    def __init__(self, pool: HostMemoryPool, metrics: LMCacheMetrics) -> None:
        self.pool = pool
        self.metrics = metrics
        self._entries: dict[bytes, _Entry] = {}
        self._order: PrefixLRU[bytes] = PrefixLRU()  # recency, parents, orphans
        self._lock = threading.RLock()

    def checksums(self, tensors: Sequence[torch.Tensor]) -> list[int]:
        """:func:`tensor_checksum` of each tensor, in one pass over the batch
        (:func:`~lmcache.tiers.checksum.batch_checksums`).

        Raises:
            ValueError: a tensor is not a contiguous CPU tensor.
        """
        return batch_checksums(tensors)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def contains(self, key: bytes) -> bool:
        """Whether ``key`` is stored (no LRU touch, no checksum verification)."""
        with self._lock:
            return key in self._entries

    def missing(self, keys: Sequence[bytes]) -> list[int]:
        """Positions of the ``keys`` not stored, in order (:meth:`contains` of each, under one
        lock acquisition; no LRU touch, no checksum verification)."""
        with self._lock:
            entries = self._entries
            return [i for i, key in enumerate(keys) if key not in entries]

    def is_orphan(self, key: bytes) -> bool:
        """Whether ``key`` is stored and the parent it was stored with is not (it is evicted
        before any other entry)."""
        with self._lock:
            return self._order.is_orphan(key)

    def touch(self, key: bytes) -> bool:
        """Mark ``key`` most recently used; returns whether it is stored."""
        with self._lock:
            return self._order.touch(key)

    def touch_many(self, keys: Iterable[bytes]) -> int:
        """Mark the stored ones of ``keys`` most recently used, ``keys[0]`` the most recent.

        ``keys`` is a run of one key chain in chain order (chunk ``i`` before chunk ``i + 1``).
        They are moved to the most-recently-used end in reverse order, so each later chunk is
        less recently used than the ones before it: eviction then takes a prompt's tail before
        its head, and chunks are never kept while the prefix they need is gone. Keys not stored
        are skipped.

        Returns:
            How many of ``keys`` are stored (and were touched).
        """
        with self._lock:
            return self._order.touch_chain(keys)

    def put(
        self,
        key: bytes,
        lease: MemoryLease,
        checksum: int | None,
        *,
        owner: bytes = b"",
        parent: bytes | None = None,
    ) -> None:
        """Store a chunk; the tier takes its own share of ``lease`` (the caller keeps theirs).

        An entry already under ``key`` is replaced (a lease someone holds on the old bytes stays
        valid). The entry becomes the most recently used. Put a run of one chain head first,
        then :meth:`touch_many` it, so its head ends up the most recent.

        Args:
            key: The chunk key.
            lease: The chunk's bytes (from :meth:`allocate`).
            checksum: :func:`tensor_checksum` of the bytes, or ``None`` to skip verification.
            owner: Who stored it, for :meth:`clear` (engines pass their metadata fingerprint).
            parent: The previous chunk's key in the chunk's key chain; ``None`` for a chain's
                first chunk, or when unknown (the entry is then never an orphan). While the
                parent is absent the entry is an orphan, evicted before anything else.
        """
        share = lease.share()
        with self._lock:
            old = self._entries.pop(key, None)
            self._entries[key] = _Entry(share, checksum, bytes(owner))
            self._order.add(key, parent)
        if old is not None:
            old.lease.release()

    def get(self, key: bytes, *, metrics: LMCacheMetrics | None = None) -> MemoryLease | None:
        """A new lease on the chunk under ``key``, or ``None`` on a miss; the caller releases it.

        Marks the entry most recently used. When the entry has a checksum and the bytes no longer
        match it, the entry is dropped, ``checksum_failures`` counted, and ``None`` returned.
        While the caller holds the lease the entry is not evicted.

        Args:
            key: The chunk key.
            metrics: Where to count a checksum failure; the tier's own metrics when ``None``.
        """
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._order.touch(key)
            lease = entry.lease.share()
        # Verified outside the lock: our share keeps the bytes from being reused meanwhile.
        return lease if self._verified([(key, entry, lease)], metrics) else None

    def get_many(
        self, keys: Sequence[bytes], *, metrics: LMCacheMetrics | None = None
    ) -> list[MemoryLease]:
        """Leases on the leading run of ``keys`` stored, each verified as :meth:`get` verifies
        it; the caller releases them.

        The run ends at the first key not stored, or whose bytes no longer match their checksum
        (that entry is dropped and ``checksum_failures`` counted, as :meth:`get` does). The
        entries are found under one lock and their checksums taken in one batch
        (:meth:`checksums`), so a run costs about what hashing its bytes costs. The run is marked
        used as :meth:`touch_many` marks it (``keys[0]`` the most recent).

        Args:
            keys: A run of one key chain, in chain order.
            metrics: Where to count a checksum failure; the tier's own metrics when ``None``.
        """
        if type(self).get is not CPUTier.get:  # a subclass keeps its entries elsewhere
            out: list[MemoryLease] = []
            for key in keys:
                lease = self.get(key, metrics=metrics)
                if lease is None:
                    break
                out.append(lease)
            return out
        found: list[tuple[bytes, _Entry, MemoryLease]] = []
        with self._lock:
            entries = self._entries
            for key in keys:
                entry = entries.get(key)
                if entry is None:
                    break
                found.append((key, entry, entry.lease.share()))
            self._order.touch_chain([key for key, _, _ in found])
        try:
            good = self._verified(found, metrics)
        except BaseException:
            for _, _, lease in found:
                lease.release()
            raise
        return [lease for _, _, lease in found[:good]]

    def _verified(
        self, found: Sequence[tuple[bytes, _Entry, MemoryLease]], metrics: LMCacheMetrics | None
    ) -> int:
        """How many leading ``(key, entry, share)`` triples' bytes match their entry's checksum
        (one batch of :meth:`checksums`). The first that does not is dropped and counted, and
        its share and every later one released."""
        todo = [i for i, (_, entry, _) in enumerate(found) if entry.checksum is not None]
        sums = self.checksums([found[i][2].tensor for i in todo]) if todo else []
        bad, value = next(
            ((i, v) for i, v in zip(todo, sums, strict=True) if v != found[i][1].checksum),
            (None, 0),
        )
        if bad is None:
            return len(found)
        key, entry, _ = found[bad]
        for _, _, lease in found[bad:]:
            lease.release()
        (self.metrics if metrics is None else metrics).checksum_failures.inc()
        logger.warning(
            "Checksum mismatch for chunk %s in the CPU tier (expected %#018x, found %#018x): "
            "the bytes changed after they were stored. Treating it as a miss and dropping it.",
            key.hex(),
            entry.checksum,
            value,
        )
        with self._lock:
            ours = self._entries.get(key) is entry  # else replaced meanwhile: not ours to drop
            if ours:
                del self._entries[key]
                self._order.discard(key)
        if ours:
            entry.lease.release()
        return bad

    def allocate(
        self,
        shape: Sequence[int],
        dtype: torch.dtype,
        *,
        metrics: LMCacheMetrics | None = None,
        protect: Container[bytes] = frozenset(),
    ) -> MemoryLease | None:
        """Allocate a chunk buffer, evicting entries until it fits (orphans first, then least
        recently used; see the module docstring).

        Only entries whose sole lease is the tier's are evicted (a chunk being read by a
        retrieve, or held by a caller, is never evicted), and never those in ``protect``.

        Args:
            shape: The buffer's shape, e.g. ``[num_layers, num_tokens, kv_width]``.
            dtype: Its element type.
            metrics: Where to count evictions; the tier's own metrics when ``None``.
            protect: Keys not to evict (the chain the buffer is for: a chunk stored at the cost
                of its own prefix would be worthless).

        Returns:
            A lease on the buffer (contents undefined), or ``None`` when nothing more can be
            evicted and it still does not fit.
        """
        leases = self.allocate_many(shape, dtype, 1, metrics=metrics, protect=protect)
        return leases[0] if leases else None

    def allocate_many(
        self,
        shape: Sequence[int],
        dtype: torch.dtype,
        count: int,
        *,
        metrics: LMCacheMetrics | None = None,
        protect: Container[bytes] = frozenset(),
    ) -> list[MemoryLease]:
        """Up to ``count`` chunk buffers of one shape (:meth:`allocate` each, in one pass:
        :meth:`HostMemoryPool.allocate_many`), evicting as :meth:`allocate` does.

        Returns:
            The leases; fewer than ``count`` when nothing more can be evicted (the caller
            stores the chunks of the leading ones: a prefix of what it meant to store).
        """
        counts = self.metrics if metrics is None else metrics
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > self.pool.budget_bytes:
            return []  # evicting cannot help
        shape = tuple(int(d) for d in shape)
        out: list[MemoryLease] = []
        with self._lock:
            # A pool short of bytes for all of them cannot fit them before that many bytes are
            # evicted (even unfragmented): evict those first, saving a failing pool pass.
            try:
                piece = aligned_bytes(nbytes)
                short = count * piece - self.pool.free_bytes
                if short > 0:
                    out += self._evict(self._victims(short, protect), counts, shape, dtype, count)
                while len(out) < count:
                    out += self.pool.allocate_many(shape, dtype, count - len(out))
                    if len(out) >= count:
                        break
                    victims = self._victims((count - len(out)) * piece, protect)
                    if not victims:
                        break
                    out += self._evict(victims, counts, shape, dtype, count - len(out))
            except BaseException:
                for lease in out:  # no buffer is lost to a failing pass
                    lease.release()
                raise
            return out

    def _evict(
        self,
        keys: list[bytes],
        counts: LMCacheMetrics,
        shape: tuple[int, ...] = (),
        dtype: torch.dtype | None = None,
        want: int = 0,
    ) -> list[MemoryLease]:
        """Drop the entries under ``keys`` (from :meth:`_victims`, so only the tier leases
        them). Up to ``want`` of those whose buffer has ``shape`` and ``dtype`` are not given
        back to the pool but returned as they are, in address order, as the buffers being
        allocated: the same bytes, the same objects, and no pool pass (a full tier's store of
        a prompt reuses an evicted prompt's back-to-back buffers). Caller holds the lock."""
        reused: list[MemoryLease] = []
        for key in keys:
            lease = self._entries.pop(key).lease
            self._order.discard(key)
            if len(reused) < want and lease.tensor.dtype == dtype and lease.tensor.shape == shape:
                reused.append(lease)
            else:
                lease.release()
        if keys:
            counts.evicted_chunks.inc(len(keys))
        reused.sort(key=lambda lease: lease.tensor.data_ptr())
        return reused

    def _victims(self, nbytes: int, protect: Container[bytes] = frozenset()) -> list[bytes]:
        """Keys of entries nobody else leases, not in ``protect``, that together take at least
        ``nbytes`` of the pool (all there are when they take less), in eviction order (orphans
        first, then least recently used, each with its descendants): a prefix of what single
        evictions would drop, found in one pass (one pool lock for the lease counts). Caller
        holds the lock."""
        entries = self._entries
        with self.pool.lease_counts() as refs:

            def size_of(key: bytes) -> int | None:
                lease = entries[key].lease
                return lease.pool_bytes if refs(lease) == 1 else None

            return self._order.victims(nbytes, size_of, protect)

    def remove(self, key: bytes) -> bool:
        """Drop the entry under ``key``; returns whether there was one (its present children
        become orphans)."""
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self._order.discard(key)
        if entry is None:
            return False
        entry.lease.release()
        return True

    def clear(self, owner: bytes | None = None) -> None:
        """Drop every entry, or only those stored with ``owner`` (leases others hold stay valid).

        Args:
            owner: ``None`` drops everything; bytes drop the entries :meth:`put` recorded with
                that owner (e.g. one engine's fingerprint on a tier shared by several).
        """
        with self._lock:
            if owner is None:
                entries = list(self._entries.values())
                self._entries.clear()
                self._order.clear()
            else:
                mine = [k for k, e in self._entries.items() if e.owner == owner]
                entries = [self._entries.pop(k) for k in mine]
                for key in mine:
                    self._order.discard(key)
        for entry in entries:
            entry.lease.release()
