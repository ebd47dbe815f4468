# SPDX-License-Identifier: Apache-2.0
"""Prometheus metrics of one lmcache instance.

Each :class:`LMCacheMetrics` owns its own ``CollectorRegistry`` unless given one, so two cache
instances (or two tests) never share counters and never collide on metric names. Exposing them is
the embedder's choice (``render()`` or the registry); lmcache itself opens no listener.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

__all__ = ["LMCacheMetrics"]

_SECONDS_BUCKETS = (
    0.0001,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


class LMCacheMetrics:
    """Counters and histograms of a cache instance, all named ``lmcache_*``.

    Attributes:
        registry: The registry every metric below is registered in.
        lookup_requests: ``lookup`` calls.
        lookup_tokens: Tokens asked about by ``lookup``.
        hit_tokens: Tokens ``lookup`` found cached.
        stored_bytes: Bytes written into the cache.
        loaded_bytes: Bytes loaded from the cache into the engine.
        stored_chunks: Chunks written into the cache.
        loaded_chunks: Chunks loaded into the engine.
        evicted_chunks: Chunks evicted to make room.
        failed_allocations: Allocations that did not fit even after eviction.
        checksum_failures: Chunks whose bytes did not match their checksum (treated as misses).
        tier_errors: Tier operations that failed or timed out (treated as misses).
        store_seconds: Wall time of ``store`` calls.
        retrieve_seconds: Wall time of ``retrieve`` calls.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        """Create the metrics in ``registry``, or in a new registry when ``None``.

        Raises:
            ValueError: ``registry`` already holds ``lmcache_*`` metrics (prometheus refuses
                duplicate names); pass a fresh registry or ``None``.
        """
        self.registry = CollectorRegistry(auto_describe=True) if registry is None else registry
        reg = self.registry
        self.lookup_requests = Counter("lmcache_lookup_requests", "lookup calls", registry=reg)
        self.lookup_tokens = Counter(
            "lmcache_lookup_tokens", "Tokens asked about by lookup", registry=reg
        )
        self.hit_tokens = Counter(
            "lmcache_hit_tokens", "Tokens found cached by lookup", registry=reg
        )
        self.stored_bytes = Counter(
            "lmcache_stored_bytes", "Bytes written into the cache", registry=reg
        )
        self.loaded_bytes = Counter(
            "lmcache_loaded_bytes", "Bytes loaded from the cache into the engine", registry=reg
        )
        self.stored_chunks = Counter(
            "lmcache_stored_chunks", "Chunks written into the cache", registry=reg
        )
        self.loaded_chunks = Counter(
            "lmcache_loaded_chunks", "Chunks loaded into the engine", registry=reg
        )
        self.evicted_chunks = Counter(
            "lmcache_evicted_chunks", "Chunks evicted to make room", registry=reg
        )
        self.failed_allocations = Counter(
            "lmcache_failed_allocations",
            "Allocations that did not fit even after eviction",
            registry=reg,
        )
        self.checksum_failures = Counter(
            "lmcache_checksum_failures",
            "Chunks whose bytes did not match their checksum (treated as misses)",
            registry=reg,
        )
        self.tier_errors = Counter(
            "lmcache_tier_errors",
            "Tier operations that failed or timed out (treated as misses)",
            registry=reg,
        )
        self.store_seconds = Histogram(
            "lmcache_store_seconds",
            "Wall time of store calls",
            registry=reg,
            buckets=_SECONDS_BUCKETS,
        )
        self.retrieve_seconds = Histogram(
            "lmcache_retrieve_seconds",
            "Wall time of retrieve calls",
            registry=reg,
            buckets=_SECONDS_BUCKETS,
        )

    def value(self, name: str) -> float:
        """Current value of a counter attribute, or the observation count of a histogram.

        Args:
            name: Attribute name, e.g. ``"checksum_failures"`` or ``"store_seconds"``.

        Returns:
            The counter's total, or the histogram's ``_count``.

        Raises:
            KeyError: ``name`` is not one of the metric attributes.
        """
        metric = getattr(self, name, None)
        if isinstance(metric, Counter):
            sample = f"lmcache_{name}_total"
        elif isinstance(metric, Histogram):
            sample = f"lmcache_{name}_count"
        else:
            raise KeyError(f"{name!r} is not an LMCacheMetrics metric attribute")
        found = self.registry.get_sample_value(sample)
        return 0.0 if found is None else float(found)

    def render(self) -> bytes:
        """Prometheus text exposition (format 0.0.4) of this instance's registry."""
        return bytes(generate_latest(self.registry))
