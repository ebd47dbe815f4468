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
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lmcache.engine.chunk_moves import Pending
from lmcache.engine.held_hit import HeldHit
from lmcache.engine.request_plan import RequestPlan
from lmcache.engine.tiers import EngineTiers
from lmcache.gpu_connector.interface import ChunkTransfer
from lmcache.memory import LeaseError, MemoryLease
from lmcache.tiers import cascade
from lmcache.tiers.cascade import ChunkShape

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
        With the CPU tier alone, its run is read in doubling runs of keys
        (:meth:`_cpu_run`); below it, :func:`lmcache.tiers.cascade.hit_run` reads the lower
        tiers.
        """
        tiers = self._tiers
        keys = plan.keys[first:] if first else plan.keys  # a lazy chain stays lazy
        ranges = plan.ranges[first:]
        full = tiers.chunk_shape(tiers.chunk_size)
        shapes = [full] * len(ranges)
        if ranges and ranges[-1][1] - ranges[-1][0] != tiers.chunk_size:
            shapes[-1] = tiers.chunk_shape(ranges[-1][1] - ranges[-1][0])

        if not tiers.stack.lower:
            return self._cpu_run(keys, shapes, held)
        lease_of = self._leaser(held)
        leases = cascade.hit_run(
            tiers.stack,
            keys,
            shapes,
            tiers.metadata.kv_dtype,
            cpu_lease=lambda i: lease_of(keys[i], shapes[i]),
            parent=plan.keys[first - 1] if first else None,
        )
        return list(zip(keys, leases, strict=False))

    def _cpu_run(
        self, keys: Sequence[bytes], shapes: Sequence[ChunkShape], held: HeldHit | None
    ) -> list[tuple[bytes, MemoryLease]]:
        """Leases on the leading ``keys`` in ``held`` or the CPU tier, up to the first miss.

        Keys are read in runs of 1, 2, 4, ... (a lazy chain hashes each run in one step, at most
        about twice as far as the hit goes). A bad token id of a list in a run is read only if
        the hit reaches it: from that run on, keys are read one at a time. On an exception the
        leases taken so far are released.
        """
        out: list[tuple[bytes, MemoryLease]] = []
        total, run = len(keys), 1
        lease_of = self._leaser(held)
        # A tier that leases a run at once: one lock and one verification batch (CPU), one
        # request (the node cache).
        get_many = getattr(self._tiers.tier, "get_many", None) if held is None else None
        try:
            while len(out) < total:
                found = len(out)
                try:
                    batch: Sequence[bytes] = keys[found : found + run]
                except (TypeError, ValueError):  # raise only for a key the hit reaches
                    batch = _OneByOne(keys, found)
                if get_many is not None and not isinstance(batch, _OneByOne):
                    try:
                        leases = get_many(batch, metrics=self._tiers.metrics)
                    except Exception as exc:
                        self._tiers.tier_error("get chunks", exc)
                        return out
                    for i, (key, lease) in enumerate(zip(batch, leases, strict=False), found):
                        if _shaped(key, lease, shapes[i]) is None:
                            for rest in leases[i - found + 1 :]:
                                rest.release()
                            return out
                        out.append((key, lease))
                    if len(leases) < len(batch):
                        return out
                    run *= 2
                    continue
                for i, key in enumerate(batch, found):
                    lease = lease_of(key, shapes[i])
                    if lease is None:
                        return out
                    out.append((key, lease))
                run *= 2
        except BaseException:
            for _, lease in out:
                lease.release()
            raise
        return out

    def _leaser(self, held: HeldHit | None) -> Callable[[bytes, ChunkShape], MemoryLease | None]:
        """``lease_of(key, shape)``: a share of ``held``'s lease on ``key``, else a verified
        lease from the CPU tier; ``None`` on a miss or a chunk of another shape.

        The tier and metrics are read once per hit, not once per chunk (a 32k-token hit has
        128 chunks).
        """
        tiers = self._tiers
        get, metrics = tiers.tier.get, tiers.metrics

        def lease_of(key: bytes, shape: ChunkShape) -> MemoryLease | None:
            lease = held.share(key) if held is not None else None
            if lease is None:
                try:
                    lease = get(key, metrics=metrics)
                except Exception as exc:
                    tiers.tier_error("get a chunk", exc)
                    return None
                if lease is None:
                    return None
            return _shaped(key, lease, shape)

        return lease_of

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


class _OneByOne(Sequence[bytes]):
    """``keys[start:]``, each key read only when it is reached (see :meth:`HitReader._cpu_run`)."""

    def __init__(self, keys: Sequence[bytes], start: int) -> None:
        self._keys, self._start = keys, start

    def __len__(self) -> int:
        return len(self._keys) - self._start

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            raise TypeError("_OneByOne is read one key at a time")
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self._keys[self._start + index]


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


def _shaped(key: bytes, lease: MemoryLease, shape: ChunkShape) -> MemoryLease | None:
    """``lease`` if its chunk has ``shape``; else ``None``, the lease released (a miss)."""
    if lease.tensor.shape == shape:
        return lease
    logger.warning(
        "Chunk %s has shape %s, expected %s; treating it as a miss.",
        key.hex(),
        tuple(lease.tensor.shape),
        shape,
    )
    lease.release()
    return None
