# SPDX-License-Identifier: Apache-2.0
"""The process-wide tiers, shared by every cache engine of one process.

A serving process may build several engine instances over its life (a notebook re-creating
``vllm.LLM``, tests, an engine restarted in place). Host memory is a process resource, so engines
with the same CPU budget share one pool and one tier: a fresh engine finds what an earlier one
stored. Chunk keys carry the model/geometry/rank fingerprint and the salt, so engines of different
models never see each other's chunks. Each engine passes its own metrics and its fingerprint as
the owner of what it stores, so its counts are its own and ``LMCacheEngine.clear()`` drops only
its own chunks.

With ``node_cache`` the CPU tier is the node's instead (:class:`~lmcache.tiers.node_tier.NodeTier`:
one per node cache folder and process, shared with every other engine process of the machine).

The disk and remote tiers are process-wide too (:func:`process_lower_tiers`): one index per disk
folder, one connection pool per Redis URL and namespace. They are closed at interpreter exit
(queued writes get up to 10 s to land) or by :func:`reset_process_cpu_tiers`.
"""

from __future__ import annotations

import atexit
import threading
from typing import TYPE_CHECKING

from lmcache.memory import HostMemoryPool
from lmcache.tiers.cpu_tier import CPUTier

if TYPE_CHECKING:
    from lmcache.config import LMCacheConfig
    from lmcache.metrics import LMCacheMetrics
    from lmcache.tiers.lower_tier import LowerTier
    from lmcache.tiers.node_tier import NodeTier

__all__ = ["process_cpu_tier", "process_lower_tiers", "reset_process_cpu_tiers"]

_lock = threading.Lock()
_tiers: dict[int, CPUTier] = {}
_lower: dict[tuple[object, ...], LowerTier] = {}
_node: dict[str, NodeTier] = {}


def process_cpu_tier(config: LMCacheConfig, metrics: LMCacheMetrics) -> CPUTier:
    """The CPU tier of this process for ``config``'s budget, created on first use.

    Args:
        config: Its ``max_local_cpu_bytes`` selects (or sizes) the shared tier.
        metrics: The tier's default metrics, taken from the first caller: they count the
            evictions and checksum failures of tier calls that pass no metrics of their own
            (:class:`~lmcache.cache_engine.LMCacheEngine` always passes its own).

    Returns:
        The same :class:`CPUTier` for every caller with the same budget; with ``node_cache``
        (and ``local_cpu``) the node tier of ``node_cache_dir``, for every caller naming it.

    Raises:
        lmcache.config.ConfigError: ``node_cache_dir`` is unusable (another user's folder, a
            path too long for a socket).
    """
    if config.node_cache and config.local_cpu:
        return _node_tier(config, metrics)
    lower = config.local_disk is not None or config.remote_url is not None
    # With local_cpu off the pool only stages transfers to and from the lower tiers.
    budget = config.max_local_cpu_bytes if config.local_cpu or lower else 0
    with _lock:
        tier = _tiers.get(budget)
        if tier is None:
            tier = CPUTier(HostMemoryPool(budget), metrics)
            _tiers[budget] = tier
        return tier


def _node_tier(config: LMCacheConfig, metrics: LMCacheMetrics) -> NodeTier:
    """The node tier of ``config``'s folder, connected (and its owner started, if allowed and
    needed: up to 10 s at the first call, so the first requests find it)."""
    from lmcache.config import ConfigError
    from lmcache.devices import host_backend
    from lmcache.node.arena import NodeCacheError, default_dir
    from lmcache.node.client import NodeClient
    from lmcache.tiers.node_tier import NodeTier

    folder = config.node_cache_dir or str(default_dir())
    with _lock:
        tier = _node.get(folder)
        if tier is None:
            try:
                client = NodeClient(
                    folder,
                    budget_bytes=config.max_local_cpu_bytes,
                    autostart=config.node_cache_autostart,
                    backend=host_backend(),
                )
            except NodeCacheError as exc:
                raise ConfigError(f"lmcache config key 'node_cache_dir': {exc}") from None
            client.connect(wait_s=10.0 if config.node_cache_autostart else 0.0)
            tier = NodeTier(client, metrics)
            _node[folder] = tier
        return tier


def process_lower_tiers(config: LMCacheConfig) -> list[LowerTier]:
    """The disk and remote tiers ``config`` names, in lookup order (disk, then remote).

    Created on first use and shared by every caller naming the same folder and budget, or the
    same URL and namespace (with the first caller's ``tier_timeout``).

    Raises:
        lmcache.config.ConfigError: an unusable folder or URL (an unreachable server is not an
            error: the tier starts degraded and answers misses until the server is back).
    """
    wanted: list[tuple[object, ...]] = []
    if config.local_disk is not None:
        wanted.append(("disk", config.local_disk, config.max_local_disk_size))
    if config.remote_url is not None:
        wanted.append(
            (
                "remote",
                config.remote_url,
                config.remote_namespace,
                config.remote_timeout,
                config.remote_ttl,
            )
        )
    out: list[LowerTier] = []
    with _lock:
        for spec in wanted:
            tier = _lower.get(spec)
            if tier is None:
                tier = _build_lower(config, spec[0])
                _lower[spec] = tier
            out.append(tier)
    return out


def _build_lower(config: LMCacheConfig, kind: object) -> LowerTier:
    if kind == "disk":
        from lmcache.tiers.disk.tier import DiskTier

        assert config.local_disk is not None
        return DiskTier(
            config.local_disk,
            int(config.max_local_disk_size * 1024**3),
            tier_timeout=config.tier_timeout or None,
        )
    from lmcache.tiers.redis.tier import RedisTier

    assert config.remote_url is not None
    return RedisTier(
        config.remote_url,
        namespace=config.remote_namespace,
        timeout=config.remote_timeout,
        ttl=config.remote_ttl or None,
        tier_timeout=config.tier_timeout or None,
    )


def reset_process_cpu_tiers() -> None:
    """Forget every shared tier: empty the CPU ones, close the disk and remote ones (their
    entries stay) and disconnect from node caches (whose chunks stay for the other processes);
    for tests and for a process that resets lmcache."""
    with _lock:
        tiers = list(_tiers.values())
        _tiers.clear()
        nodes = list(_node.values())
        _node.clear()
        lower = list(_lower.values())
        _lower.clear()
    for tier in tiers:
        tier.clear()
    for node in nodes:
        node.close()
    for low in lower:
        low.close()


def _close_lower_at_exit() -> None:
    with _lock:
        lower = list(_lower.values())
        _lower.clear()
    for low in lower:
        low.close()


atexit.register(_close_lower_at_exit)
