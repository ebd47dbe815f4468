# SPDX-License-Identifier: Apache-2.0
"""How the cache engine finds and leases the chunks a lookup or retrieve hits.

A hit is the longest run of stored chunks of one request, searched in every tier
(:func:`lmcache.tiers.cascade.hit_run`). A chunk found only below the CPU tier is read,
verified and promoted first. Each hit chunk is leased, so it cannot be evicted while in use.
A chunk of a :class:`~lmcache.engine.held_hit.HeldHit` gets a share of its lease instead, not
verified again. A chunk of the wrong shape is a miss.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from lmcache.engine.chunk_moves import Pending
from lmcache.engine.held_hit import HeldHit
from lmcache.engine.request_plan import RequestPlan
from lmcache.engine.tiers import EngineTiers
from lmcache.gpu_connector.interface import ChunkTransfer
from lmcache.memory import LeaseError, MemoryLease
from lmcache.tiers import cascade

__all__ = ["HitReader", "check_held", "hit_mask"]

logger = logging.getLogger(__name__)


class HitReader:
    """Finds, verifies and leases the hit chunks of one engine's requests.

    Args:
        tiers: The engine's tiers, metrics and chunk geometry.
    """

    def __init__(self, tiers: EngineTiers) -> None:
        self._tiers = tiers

    def hit_run(
        self, plan: RequestPlan, first: int, held: HeldHit | None = None
    ) -> list[tuple[bytes, MemoryLease]]:
        """Leases on the longest run of stored chunks from chunk ``first`` on, in any tier.

        Chunks in ``held`` get a share of its lease. The caller releases the leases.
        """
        tiers = self._tiers
        keys = plan.keys[first:] if first else plan.keys  # a lazy chain stays lazy
        ranges = plan.ranges[first:]
        shapes = [tiers.chunk_shape(tiers.chunk_size)] * len(ranges)
        if ranges and ranges[-1][1] - ranges[-1][0] != tiers.chunk_size:
            shapes[-1] = tiers.chunk_shape(ranges[-1][1] - ranges[-1][0])

        def cpu_lease(i: int) -> MemoryLease | None:
            start, end = ranges[i]
            lease = held.share(keys[i]) if held is not None else None
            if lease is not None:
                return self._check_shape(keys[i], lease, end - start)
            return self._get(keys[i], start, end)

        leases = cascade.hit_run(
            tiers.stack,
            keys,
            shapes,
            tiers.metadata.kv_dtype,
            cpu_lease=cpu_lease,
            parent=plan.keys[first - 1] if first else None,
        )
        return list(zip(keys, leases, strict=False))

    def acquire(self, plan: RequestPlan, held: HeldHit | None = None) -> list[Pending]:
        """Leases on the longest run of present chunks after the masked prefix.

        Chunks in ``held`` get a share of its lease (verified at ``lookup_and_lease``, not
        hashed again). The others come from the tier, verified.
        """
        run = self.hit_run(plan, plan.first_chunk, held)
        pending = [
            Pending(
                key,
                ChunkTransfer(
                    *plan.ranges[plan.first_chunk + n], lease.tensor, checksum=lease.checksum
                ),
                lease,
            )
            for n, (key, lease) in enumerate(run)
        ]
        self._tiers.touch(plan.keys[: plan.first_chunk + len(pending)])
        return pending

    def count_lookup(self, plan: RequestPlan, found: int) -> int:
        """Count a lookup that found ``found`` chunks; returns the hit tokens."""
        hit = plan.ranges[found - 1][1] if found else 0
        metrics = self._tiers.metrics
        metrics.lookup_requests.inc()
        metrics.lookup_tokens.inc(plan.num_tokens)
        metrics.hit_tokens.inc(hit)
        return hit

    def cut_held_hit(self, hit: HeldHit, ok: Sequence[bool]) -> None:
        """Shorten ``hit`` before its first chunk with ``ok[i]`` false; drop each such chunk.

        See :meth:`lmcache.cache_engine.LMCacheEngine.cut_held_hit`.
        """
        bad = [i for i, good in enumerate(ok) if not good]
        if not bad:
            return
        for i in bad:
            logger.warning(
                "Checksum mismatch for chunk %s in the CPU tier: its bytes changed after they "
                "were stored. Treating it as a miss and dropping it.",
                hit.keys[i].hex(),
            )
            self._tiers.drop_bad_chunk(hit.keys[i])
        hit.truncate(bad[0], bad[0] * self._tiers.chunk_size)

    def _get(self, key: bytes, start: int, end: int) -> MemoryLease | None:
        """A verified lease on chunk ``key`` of tokens ``[start, end)``, or ``None`` on a miss."""
        tiers = self._tiers
        try:
            lease = tiers.tier.get(key, metrics=tiers.metrics)
        except Exception as exc:
            tiers.tier_error("get a chunk", exc)
            return None
        return None if lease is None else self._check_shape(key, lease, end - start)

    def _check_shape(self, key: bytes, lease: MemoryLease, num_tokens: int) -> MemoryLease | None:
        """``lease`` if its buffer has the chunk's shape; else it is released (a miss)."""
        expected = self._tiers.chunk_shape(num_tokens)
        if lease.tensor.shape == expected:
            return lease
        logger.warning(
            "Chunk %s has shape %s, expected %s; treating it as a miss.",
            key.hex(),
            tuple(lease.tensor.shape),
            expected,
        )
        lease.release()
        return None


def check_held(held: HeldHit | None, action: str) -> None:
    """Refuse a held hit released before the retrieve that uses it.

    Raises:
        LeaseError: ``held`` was released already.
    """
    if held is not None and held.released:
        raise LeaseError(
            f"LMCacheEngine.{action}: held={held!r} was released before the {action}; its "
            "chunks may be gone. Release it after the retrieve, or pass held=None."
        )


def hit_mask(plan: RequestPlan, pending: Sequence[Pending]) -> torch.Tensor:
    """bool ``[num_tokens]``: ``True`` exactly for the tokens of the hit chunks."""
    mask = torch.zeros(plan.num_tokens, dtype=torch.bool)
    if pending:
        mask[pending[0].chunk.start : pending[-1].chunk.end] = True
    return mask
