# SPDX-License-Identifier: Apache-2.0
"""Leases on a run of stored pages (:class:`HeldPages`), and how a hit takes them (:func:`hit_run`).

A hit's pages in the CPU tier are leased under one lock and verified in one batch of checksums
(:meth:`lmcache.tiers.CPUTier.get_many`), so a 128-page hit costs about what hashing its bytes
costs. From the first page that batch does not cover (not in the CPU tier, corrupt, or of another
shape), the hit goes on as :func:`lmcache.tiers.cascade.hit_run` goes: one page at a time from the
CPU tier, runs from disk or Redis. A corrupt page is therefore a miss there (counted, dropped) and
may still come from a lower tier that holds it intact.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from lmcache.gpu_connector.interface import ChunkTransfer
from lmcache.memory import MemoryLease
from lmcache.tiers import cascade

__all__ = ["HeldPages", "hit_run"]

logger = logging.getLogger(__name__)


@dataclass
class HeldPages:
    """Leases on a run of stored pages, in page order, and their tier keys; release when done.

    Each page was verified when it was held, or carries the sum its device computed
    (``lease.checksum``), which the connector verifies when ``PageStore.load`` writes it.
    """

    leases: list[MemoryLease]
    keys: list[bytes] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.leases)

    def release(self) -> None:
        """Release every lease not released yet (idempotent)."""
        for lease in self.leases:
            if not lease.released:
                lease.release()

    def chunks(self, page_size: int) -> list[ChunkTransfer]:
        """The pages as chunks of a request whose tokens are these pages in order, each with
        the device sum it carries (``None``: none to verify at load)."""
        return [
            ChunkTransfer(i * page_size, (i + 1) * page_size, lease.tensor, lease.checksum)
            for i, lease in enumerate(self.leases)
        ]


def _cpu_run(
    stack: cascade.TierStack, keys: Sequence[bytes], shape: tuple[int, ...], dtype: torch.dtype
) -> list[MemoryLease]:
    """Verified leases on the leading run of ``keys`` in the CPU tier (one lock, one batch of
    checksums), cut before a page of another shape or dtype; a tier error is an empty run,
    counted."""
    try:
        run = stack.cpu.get_many(keys, metrics=stack.metrics)
    except Exception as exc:
        stack.metrics.tier_errors.inc()
        logger.warning("CPU tier failed to get pages (%r); treating it as a miss.", exc)
        return []
    ok = next(
        (i for i, x in enumerate(run) if x.tensor.shape != shape or x.tensor.dtype != dtype),
        len(run),
    )
    for lease in run[ok:]:  # the page-by-page lookup from there logs it and misses
        lease.release()
    return run[:ok]


def hit_run(
    stack: cascade.TierStack, keys: Sequence[bytes], shape: tuple[int, ...], dtype: torch.dtype
) -> list[MemoryLease]:
    """Verified leases on the longest run of leading ``keys`` stored in any tier of ``stack``
    (pages of one ``shape`` and ``dtype``; see the module docstring). The caller releases them.
    """
    run = _cpu_run(stack, keys, shape, dtype)
    handed = 0

    def from_cpu(i: int) -> MemoryLease | None:
        nonlocal handed
        if i < len(run):
            handed = i + 1
            return run[i]
        return cascade.cpu_get(stack, keys[i], shape, dtype)

    try:
        return cascade.hit_run(stack, keys, [shape] * len(keys), dtype, cpu_lease=from_cpu)
    finally:
        for lease in run[handed:]:  # only after an error: the run's keys are asked first
            lease.release()
