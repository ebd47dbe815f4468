# SPDX-License-Identifier: Apache-2.0
"""The process-wide CPU tier, shared by every cache engine of one process.

A serving process may build several engine instances over its life (a notebook re-creating
``vllm.LLM``, tests, an engine restarted in place). Host memory is a process resource, so engines
with the same CPU budget share one pool and one tier: a fresh engine finds what an earlier one
stored. Chunk keys carry the model/geometry/rank fingerprint and the salt, so engines of different
models never see each other's chunks. Each engine passes its own metrics and its fingerprint as
the owner of what it stores, so its counts are its own and ``LMCacheEngine.clear()`` drops only
its own chunks.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from lmcache.memory import HostMemoryPool
from lmcache.tiers.cpu_tier import CPUTier

if TYPE_CHECKING:
    from lmcache.config import LMCacheConfig
    from lmcache.metrics import LMCacheMetrics

__all__ = ["process_cpu_tier", "reset_process_cpu_tiers"]

_lock = threading.Lock()
_tiers: dict[int, CPUTier] = {}


def process_cpu_tier(config: LMCacheConfig, metrics: LMCacheMetrics) -> CPUTier:
    """The CPU tier of this process for ``config``'s budget, created on first use.

    Args:
        config: Its ``max_local_cpu_bytes`` selects (or sizes) the shared tier.
        metrics: The tier's default metrics, taken from the first caller: they count the
            evictions and checksum failures of tier calls that pass no metrics of their own
            (:class:`~lmcache.cache_engine.LMCacheEngine` always passes its own).

    Returns:
        The same :class:`CPUTier` for every caller with the same budget.
    """
    budget = config.max_local_cpu_bytes if config.local_cpu else 0
    with _lock:
        tier = _tiers.get(budget)
        if tier is None:
            tier = CPUTier(HostMemoryPool(budget), metrics)
            _tiers[budget] = tier
        return tier


def reset_process_cpu_tiers() -> None:
    """Forget (and empty) every shared tier; for tests and for a process that resets lmcache."""
    with _lock:
        tiers = list(_tiers.values())
        _tiers.clear()
    for tier in tiers:
        tier.clear()
