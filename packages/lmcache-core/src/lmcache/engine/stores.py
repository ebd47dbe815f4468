# SPDX-License-Identifier: Apache-2.0
"""How the cache engine leases buffers for a store and publishes them once filled.

A store saves the chunks after the request's masked prefix that no tier holds yet.
A trailing partial chunk is saved only with ``save_unfull_chunk``.
When host memory runs short it saves the leading chunks that fit and never blocks.
It never evicts the prefix it extends to make room: those chunks could then never be hit.
Filled buffers are checksummed and handed to the tiers (:func:`lmcache.tiers.cascade.publish`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from lmcache.engine.chunk_moves import Pending
from lmcache.engine.request_plan import RequestPlan
from lmcache.engine.tiers import EngineTiers
from lmcache.gpu_connector.interface import ChunkTransfer
from lmcache.tiers import cascade

__all__ = ["StoreWriter"]

logger = logging.getLogger(__name__)


class StoreWriter:
    """Leases the buffers of one engine's stores and commits them; a
    :class:`~lmcache.engine.chunk_moves.StoreCommitter`.

    Args:
        tiers: The engine's tiers, metrics and chunk geometry.
        save_unfull_chunk: Whether a trailing partial chunk is stored (``config.save_unfull_chunk``).
    """

    def __init__(self, tiers: EngineTiers, *, save_unfull_chunk: bool) -> None:
        self._tiers = tiers
        self._save_unfull_chunk = save_unfull_chunk

    def allocate(self, plan: RequestPlan) -> list[Pending]:
        """Lease buffers for the chunks a store saves (leading ones only when memory is short).

        The prefix they extend (the request's chunks before the last one stored) is never
        evicted for them (``protect``): chunks stored at the cost of their own prefix could
        never be hit. Each records its parent (the previous chunk's key).
        """
        tiers = self._tiers
        chunk_size = tiers.chunk_size
        pending: list[Pending] = []
        candidates = [
            i
            for i in range(plan.first_chunk, len(plan.keys))
            if plan.ranges[i][1] - plan.ranges[i][0] == chunk_size
            or self._save_unfull_chunk  # else: a trailing partial chunk, not saved
        ]
        todo = [
            candidates[n]
            for n in cascade.keys_to_store(tiers.stack, [plan.keys[i] for i in candidates])
        ]
        tiers.touch(plan.keys)  # this chain's present chunks are the last to be evicted
        protect = frozenset(plan.keys[: todo[-1]]) if todo else frozenset()  # the prefix
        n = 0
        while n < len(todo):  # runs of chunks of one size, each leased in one pass
            tokens = plan.ranges[todo[n]][1] - plan.ranges[todo[n]][0]
            run = 1
            while n + run < len(todo) and (
                plan.ranges[todo[n + run]][1] - plan.ranges[todo[n + run]][0] == tokens
            ):
                run += 1
            try:
                leases = tiers.tier.allocate_many(
                    tiers.chunk_shape(tokens),
                    tiers.metadata.kv_dtype,
                    run,
                    metrics=tiers.metrics,
                    protect=protect,
                )
            except Exception as exc:
                tiers.tier_error("allocate", exc)
                leases = []
            for i, lease in zip(todo[n : n + run], leases, strict=False):
                start, end = plan.ranges[i]
                parent = plan.keys[i - 1] if i else None
                pending.append(
                    Pending(plan.keys[i], ChunkTransfer(start, end, lease.tensor), lease, parent)
                )
            if len(leases) < run:
                tiers.metrics.failed_allocations.inc()
                logger.debug(
                    "Out of host memory: storing %d of %d chunks.", len(pending), len(todo)
                )
                break
            n += run
        return pending

    def commit_store(
        self,
        pending: Sequence[Pending],
        started: float,
        chain: Sequence[bytes] = (),
        sums: Sequence[int] | None = None,
    ) -> int:
        """Checksum the filled buffers and hand them to the tier; returns tokens stored.

        ``sums`` are the chunks' ``lmcache-mix64-sum`` values computed by the connector on the
        device. They stay with the bytes (``MemoryLease.checksum``), and the host does not
        hash those chunks again. ``chain`` (the request's keys) is then marked used in chain
        order.
        """
        tiers = self._tiers
        if sums is not None and tiers.stack.checksum:
            for p, value in zip(pending, sums, strict=True):
                p.lease.checksum = value
        committed = cascade.publish(
            tiers.stack, [(p.key, p.lease) for p in pending], [p.parent for p in pending]
        )
        stored_tokens = sum(p.chunk.num_tokens for p in pending[:committed])
        tiers.touch(chain)
        tiers.metrics.store_seconds.observe(time.perf_counter() - started)
        return stored_tokens
