# SPDX-License-Identifier: Apache-2.0
"""The node tier: the CPU tier's API over the node cache, one host cache for every engine process
of the machine (``node_cache: true``; design in ``docs/node_cache.md``).

Chunk bytes live in the node's arena (:mod:`lmcache.node.arena`), mapped by every engine
process; the owner process (:mod:`lmcache.node.server`) keeps the index, the leases and the
eviction order. :class:`NodeTier` answers each call of :class:`~lmcache.tiers.CPUTier` through a
:class:`~lmcache.node.client.NodeClient`:

- :meth:`~NodeTier.allocate_many` leases fresh arena blocks (the owner evicts for them, orphans
  first and a chain's tail before its head, never ``protect``); the leases are
  :class:`~lmcache.memory.MemoryLease` objects over the arena's bytes.
- :meth:`~NodeTier.put` commits a filled block under its key, with its xxh3 checksum: only then
  do other processes see it.
- :meth:`~NodeTier.get` leases a committed chunk and verifies its checksum on the host before
  handing it out: a mismatch is a miss, counted in ``checksum_failures``, and the entry dropped.

When the owner is down or slow, lookups are misses, stores are skipped and nothing raises: the
engine serves on, recomputing.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Container, Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from lmcache.devices import get_backend
from lmcache.memory import HostMemoryPool, MemoryLease
from lmcache.node import wire
from lmcache.node.client import NodeClient, dtype_name
from lmcache.tiers.cpu_tier import CPUTier

if TYPE_CHECKING:
    from lmcache.metrics import LMCacheMetrics

__all__ = ["NodeTier"]

logger = logging.getLogger(__name__)


class _NodeBudget(HostMemoryPool):
    """What the engine reads of a tier's pool, its budget, reporting the node's arena.

    Chunk buffers come from :meth:`NodeTier.allocate_many`, never from here.
    """

    def __init__(self, client: NodeClient) -> None:
        super().__init__(0, pin=False, backend=get_backend("cpu"))
        self._client = client

    @property
    def budget_bytes(self) -> int:
        return self._client.budget_bytes

    def allocate_many(
        self, shape: Sequence[int], dtype: torch.dtype, count: int
    ) -> list[MemoryLease]:
        return []


class NodeTier(CPUTier):
    """The CPU tier's methods over the node cache (see the module docstring).

    Thread-safe (the client serialises requests).

    Args:
        client: The connection to the node's owner.
        metrics: Counts evictions and checksum failures of calls that pass no ``metrics``.
    """

    round_trips = True
    """Each query is a request to the owner: a lookup asks about a whole chain at once."""

    def __init__(self, client: NodeClient, metrics: LMCacheMetrics) -> None:
        super().__init__(_NodeBudget(client), metrics)
        self.client = client

    def close(self) -> None:
        """Drop the connection; this process's leases go when it exits (or after the owner's
        grace period)."""
        self.client.close()

    def stats(self) -> wire.StatsReply | None:
        """The owner's counters, or ``None`` when it is unavailable."""
        return self.client.call(wire.Stats(), wire.StatsReply)

    def __len__(self) -> int:
        stats = self.stats()
        return 0 if stats is None else stats.entries

    # ------------------------------------------------------------------ lookups

    def contains(self, key: bytes) -> bool:
        """Whether ``key`` is committed on the node (``False`` when the owner is unavailable)."""
        return not self.missing([key])

    def missing(self, keys: Sequence[bytes]) -> list[int]:
        """Positions of the ``keys`` not committed on the node, in order: one request per
        :data:`~lmcache.node.wire.MAX_KEYS` keys (all of them when the owner is unavailable)."""
        out: list[int] = []
        step = wire.MAX_KEYS
        for start in range(0, len(keys), step):
            run = [bytes(k) for k in keys[start : start + step]]
            reply = self.client.call(wire.Missing(run), wire.MissingReply)
            if reply is None:
                return out + list(range(start, len(keys)))
            out += [start + i for i in reply.positions]
        return out

    def is_orphan(self, key: bytes) -> bool:
        reply = self.client.call(wire.IsOrphan(bytes(key)), wire.BoolReply)
        return reply is not None and reply.value

    def touch(self, key: bytes) -> bool:
        self.client.send(wire.Touch([bytes(key)]))
        return self.contains(key)

    def touch_many(self, keys: Iterable[bytes]) -> int:
        """Mark a run of one key chain used, ``keys[0]`` the most recent (one-way: the owner
        touches those it holds).

        Returns:
            How many keys were sent (0 when the owner is unavailable).
        """
        run = [bytes(k) for k in keys]
        sent = 0
        # the last part first: each part is touched tail first, so keys[0] ends the most recent
        for start in reversed(range(0, len(run), wire.MAX_KEYS)):
            part = run[start : start + wire.MAX_KEYS]
            if not self.client.send(wire.Touch(part)):
                break
            sent += len(part)
        return sent

    # ------------------------------------------------------------------ chunks

    def put(
        self,
        key: bytes,
        lease: MemoryLease,
        checksum: int | None,
        *,
        owner: bytes = b"",
        parent: bytes | None = None,
    ) -> None:
        """Commit a filled buffer from :meth:`allocate` under ``key``; the caller keeps and
        releases its lease. The commit is queued and goes out with the next request (a store's
        commits leave together), always before the buffer's release. A buffer of an owner that
        has restarted since, or any while the owner is away, is skipped.

        Raises:
            ValueError: ``lease`` is not a buffer of this tier.
        """
        if lease._pool is not self.client:
            raise ValueError(
                "NodeTier.put: expected a lease from NodeTier.allocate (arena bytes), found "
                f"{lease!r}; allocate chunk buffers from the tier the chunk is put into."
            )
        block = self.client.current_block(lease)
        if block is None or not self.client.connected:
            logger.debug("node cache: skipping the put of %s (owner away)", key.hex())
            return
        tensor = lease.tensor
        commit = wire.Commit(
            block,
            bytes(key),
            None if parent is None else bytes(parent),
            bytes(owner),
            checksum,
            lease.checksum,
            [int(d) for d in tensor.shape],
            dtype_name(tensor.dtype),
        )
        self.client.post(lease, commit)

    def get(self, key: bytes, *, metrics: LMCacheMetrics | None = None) -> MemoryLease | None:
        """A verified lease on the chunk under ``key`` (any process may have stored it), or
        ``None`` on a miss, a checksum mismatch (counted, entry dropped) or an unavailable
        owner; the caller releases it. Marks the chunk used."""
        got = self.client.get_many([bytes(key)])
        if not got:
            return None
        ((lease, record),) = got
        if record.checksum is None:
            return lease
        found = self.checksums([lease.tensor])[0]
        if found == record.checksum:
            return lease
        lease.release()
        (self.metrics if metrics is None else metrics).checksum_failures.inc()
        logger.warning(
            "Checksum mismatch for chunk %s in the node cache (expected %#018x, found %#018x): "
            "the bytes changed after they were stored. Treating it as a miss and dropping it.",
            key.hex(),
            record.checksum,
            found,
        )
        self.client.send(wire.Drop(bytes(key), record.block))
        return None

    def get_many(
        self, keys: Sequence[bytes], *, metrics: LMCacheMetrics | None = None
    ) -> list[MemoryLease]:
        """Verified leases on the longest run of leading ``keys`` stored on the node, in one
        request to the owner (:meth:`get` of each, up to the first miss or mismatch, which is
        counted and dropped as in :meth:`get`); the caller releases them."""
        got = self.client.get_many(keys)
        todo = [i for i, (_, record) in enumerate(got) if record.checksum is not None]
        found = dict(zip(todo, self.checksums([got[i][0].tensor for i in todo]), strict=True))
        out: list[MemoryLease] = []
        for i, (lease, record) in enumerate(got):
            if i in found and found[i] != record.checksum:
                (self.metrics if metrics is None else metrics).checksum_failures.inc()
                logger.warning(
                    "Checksum mismatch for chunk %s in the node cache (expected %#018x, found "
                    "%#018x): treating it as a miss and dropping it.",
                    keys[i].hex(),
                    record.checksum,
                    found[i],
                )
                self.client.send(wire.Drop(bytes(keys[i]), record.block))
                for rest, _ in got[i:]:
                    rest.release()
                break
            out.append(lease)
        return out

    def allocate_many(
        self,
        shape: Sequence[int],
        dtype: torch.dtype,
        count: int,
        *,
        metrics: LMCacheMetrics | None = None,
        protect: Container[bytes] = frozenset(),
    ) -> list[MemoryLease]:
        """Up to ``count`` arena buffers of one shape, the owner evicting unleased entries
        (orphans first, then least recently used, never ``protect``) to make room.

        Returns:
            The leases; fewer than ``count`` when nothing more can be evicted, none when the
            owner is unavailable.
        """
        shape = tuple(int(d) for d in shape)
        nbytes = math.prod(shape) * dtype.itemsize
        if count <= 0 or nbytes > self.pool.budget_bytes:
            return []
        keep = [bytes(k) for k in protect] if isinstance(protect, Iterable) else []
        out: list[MemoryLease] = []
        while len(out) < count:
            want = min(count - len(out), wire.MAX_KEYS)
            leases, evicted = self.client.alloc(shape, dtype, want, keep)
            if evicted:
                (self.metrics if metrics is None else metrics).evicted_chunks.inc(evicted)
            out += leases
            if len(leases) < want:
                break
        return out

    def remove(self, key: bytes) -> bool:
        reply = self.client.call(wire.Remove(bytes(key)), wire.BoolReply)
        return reply is not None and reply.value

    def clear(self, owner: bytes | None = None) -> None:
        """Drop every chunk of the node, or those committed with ``owner`` (leases others hold
        stay valid)."""
        self.client.call(wire.Clear(None if owner is None else bytes(owner)), wire.CountReply)
