# SPDX-License-Identifier: Apache-2.0
"""Prometheus metrics of one lmcache instance.

Each :class:`LMCacheMetrics` owns its own ``CollectorRegistry`` unless given one, so two cache
instances (or two tests) never share counters and never collide on metric names. Several
instances may share one registry when each has its own ``labels`` values (e.g.
``{"engine": "a"}`` and ``{"engine": "b"}``): the ``lmcache_*`` metric families are created once
per registry and each instance counts into its own labelled series. Exposing them is the
embedder's choice (``render()`` or the registry); lmcache itself opens no listener.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

__all__ = ["LMCacheMetrics"]

_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_RESERVED_LABELS = frozenset({"le", "quantile"})

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


#: (attribute, kind, help) of every metric; each is named ``lmcache_<attribute>``.
_SPECS: tuple[tuple[str, type[Counter] | type[Histogram], str], ...] = (
    ("lookup_requests", Counter, "lookup calls"),
    ("lookup_tokens", Counter, "Tokens asked about by lookup"),
    ("hit_tokens", Counter, "Tokens found cached by lookup"),
    ("stored_bytes", Counter, "Bytes written into the cache"),
    ("loaded_bytes", Counter, "Bytes loaded from the cache into the engine"),
    ("stored_chunks", Counter, "Chunks written into the cache"),
    ("loaded_chunks", Counter, "Chunks loaded into the engine"),
    ("evicted_chunks", Counter, "Chunks evicted to make room"),
    ("failed_allocations", Counter, "Allocations that did not fit even after eviction"),
    (
        "checksum_failures",
        Counter,
        "Chunks whose bytes did not match their checksum (treated as misses)",
    ),
    ("tier_errors", Counter, "Tier operations that failed or timed out (treated as misses)"),
    (
        "tier_timeouts",
        Counter,
        "Disk/remote reads abandoned past tier_timeout without progress (treated as misses; "
        "also counted in tier_errors)",
    ),
    ("disk_hit_chunks", Counter, "Chunks read from the local disk tier (verified)"),
    ("remote_hit_chunks", Counter, "Chunks read from the remote tier (verified)"),
    ("disk_stored_chunks", Counter, "Chunks written to the local disk tier"),
    ("remote_stored_chunks", Counter, "Chunks written to the remote tier"),
    ("dropped_writes", Counter, "Disk/remote writes dropped because the write queue was full"),
    ("store_seconds", Histogram, "Wall time of store calls"),
    ("retrieve_seconds", Histogram, "Wall time of retrieve calls"),
)


@dataclass(eq=False)
class _Families:
    """The ``lmcache_*`` metric families of one registry and the label values in use."""

    labelnames: tuple[str, ...]
    metrics: dict[str, Counter | Histogram]
    in_use: set[tuple[str, ...]] = field(default_factory=set)


_families_lock = threading.Lock()
#: Metric families per registry, so instances with different label values can share one. Weak
#: keys: the entry goes with its registry (the families do not refer back to it).
_families: weakref.WeakKeyDictionary[CollectorRegistry, _Families] = weakref.WeakKeyDictionary()


def _check_labels(labels: Mapping[str, str] | None) -> dict[str, str]:
    if labels is None:
        return {}
    out: dict[str, str] = {}
    for name, value in labels.items():
        if (
            not isinstance(name, str)
            or not _LABEL_NAME.fullmatch(name)
            or name.startswith("__")
            or name in _RESERVED_LABELS
        ):
            raise ValueError(
                f"LMCacheMetrics label name {name!r} is not usable: expected a Prometheus label "
                "name ([a-zA-Z_][a-zA-Z0-9_]*, not starting with '__', not 'le' or 'quantile'), "
                'e.g. labels={"engine": "0"}.'
            )
        if not isinstance(value, str):
            raise TypeError(
                f"LMCacheMetrics label {name}={value!r} is a {type(value).__name__}, expected a "
                f"str; pass str({value!r})."
            )
        out[name] = value
    return out


def _new_families(
    registry: CollectorRegistry, labelnames: tuple[str, ...]
) -> dict[str, Counter | Histogram]:
    metrics: dict[str, Counter | Histogram] = {}
    try:
        for attr, kind, doc in _SPECS:
            if kind is Histogram:
                metrics[attr] = Histogram(
                    f"lmcache_{attr}",
                    doc,
                    labelnames=labelnames,
                    registry=registry,
                    buckets=_SECONDS_BUCKETS,
                )
            else:
                metrics[attr] = Counter(
                    f"lmcache_{attr}", doc, labelnames=labelnames, registry=registry
                )
    except ValueError as exc:
        for metric in metrics.values():
            registry.unregister(metric)
        raise ValueError(
            f"LMCacheMetrics: the registry already holds lmcache_* metrics that this class did "
            f"not create ({exc}). Pass a registry without them, or None for a fresh one."
        ) from exc
    return metrics


def _child_value(child: object) -> float | None:
    """A counter's total or a histogram's count read from this instance's own series.

    ``registry.get_sample_value`` collects every metric of the registry (milliseconds with a
    few engines), too slow for vLLM's per-step stats; this reads prometheus-client's value
    holders instead, or returns ``None`` when a version lays them out otherwise (the caller
    falls back to the registry)."""
    try:
        if isinstance(child, Counter):
            return float(child._value.get())
        if isinstance(child, Histogram):
            return float(sum(b.get() for b in child._buckets))
    except AttributeError:
        return None
    return None


class LMCacheMetrics:
    """Counters and histograms of a cache instance, all named ``lmcache_*``.

    Args:
        registry: Where the metrics are registered; a new ``CollectorRegistry`` when ``None``.
        labels: Label names and values of this instance's series, e.g. ``{"engine": "0"}``.
            Every metric gets the label names ``sorted(labels)``; the attributes below are the
            children for these values, so ``metrics.hit_tokens.inc()`` counts into them.
            Instances sharing a registry must use the same label names and distinct values.

    Raises:
        ValueError: ``registry`` already holds ``lmcache_*`` metrics with other label names, or
            an instance with these label values (they would count into the same series), or
            ``lmcache_*`` metrics not created by this class; or a label name is not valid.
        TypeError: a label value is not a str.

    Attributes:
        registry: The registry every metric below is registered in.
        labels: This instance's label values (``{}`` when unlabelled).
        lookup_requests: ``lookup`` calls.
        lookup_tokens: Tokens asked about by ``lookup``.
        hit_tokens: Tokens ``lookup`` found cached.
        stored_bytes: Bytes written into the cache.
        loaded_bytes: Bytes loaded from the cache into the engine.
        stored_chunks: Chunks written into the cache.
        loaded_chunks: Chunks loaded into the engine.
        evicted_chunks: Chunks evicted to make room for this instance's stores.
        failed_allocations: Allocations that did not fit even after eviction.
        checksum_failures: Chunks whose bytes did not match their checksum (treated as misses).
        tier_errors: Tier operations that failed or timed out (treated as misses).
        tier_timeouts: Disk/remote reads abandoned past ``tier_timeout`` (also in
            ``tier_errors``).
        disk_hit_chunks: Chunks read from the local disk tier (verified).
        remote_hit_chunks: Chunks read from the remote tier (verified).
        disk_stored_chunks: Chunks written to the local disk tier.
        remote_stored_chunks: Chunks written to the remote tier.
        dropped_writes: Disk/remote writes dropped because the write queue was full.
        store_seconds: Wall time of ``store`` calls.
        retrieve_seconds: Wall time of ``retrieve`` calls.
    """

    lookup_requests: Counter
    lookup_tokens: Counter
    hit_tokens: Counter
    stored_bytes: Counter
    loaded_bytes: Counter
    stored_chunks: Counter
    loaded_chunks: Counter
    evicted_chunks: Counter
    failed_allocations: Counter
    checksum_failures: Counter
    tier_errors: Counter
    tier_timeouts: Counter
    disk_hit_chunks: Counter
    remote_hit_chunks: Counter
    disk_stored_chunks: Counter
    remote_stored_chunks: Counter
    dropped_writes: Counter
    store_seconds: Histogram
    retrieve_seconds: Histogram

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        labels: Mapping[str, str] | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True) if registry is None else registry
        self.labels = _check_labels(labels)
        labelnames = tuple(sorted(self.labels))
        values = tuple(self.labels[name] for name in labelnames)
        with _families_lock:
            families = _families.get(self.registry)
            if families is None:
                families = _Families(labelnames, _new_families(self.registry, labelnames))
                _families[self.registry] = families
            elif families.labelnames != labelnames:
                raise ValueError(
                    f"LMCacheMetrics: this registry's lmcache_* metrics have label names "
                    f"{list(families.labelnames)}, found labels {self.labels}. Instances sharing "
                    "a registry need the same label names; use them, or another registry."
                )
            elif values in families.in_use:
                raise ValueError(
                    f"LMCacheMetrics: this registry already has an instance with labels "
                    f"{self.labels or '{}'}; a second one would count into the same series. Pass "
                    "distinct label values (e.g. an engine id), a fresh registry, or call "
                    "unregister() on the old instance first."
                )
            families.in_use.add(values)
        self._families = families
        self._values = values
        self._registered = True
        for attr, metric in families.metrics.items():
            setattr(self, attr, metric.labels(*values) if values else metric)

    def value(self, name: str) -> float:
        """Current value of this instance's counter, or the observation count of a histogram.

        Args:
            name: Attribute name, e.g. ``"checksum_failures"`` or ``"store_seconds"``.

        Returns:
            The counter's total, or the histogram's ``_count``, for this instance's labels.

        Raises:
            KeyError: ``name`` is not one of the metric attributes.
        """
        metric = self._families.metrics.get(name)
        if isinstance(metric, Counter):
            sample = f"lmcache_{name}_total"
        elif isinstance(metric, Histogram):
            sample = f"lmcache_{name}_count"
        else:
            raise KeyError(f"{name!r} is not an LMCacheMetrics metric attribute")
        fast = _child_value(getattr(self, name))
        if fast is not None:
            return fast
        found = self.registry.get_sample_value(sample, self.labels)
        return 0.0 if found is None else float(found)

    def render(self) -> bytes:
        """Prometheus text exposition (format 0.0.4) of this instance's registry.

        With a shared registry that includes the other instances' series.
        """
        return bytes(generate_latest(self.registry))

    def unregister(self) -> None:
        """Remove this instance's series from the registry (idempotent).

        Its label values may then be used by a new instance; the attributes keep counting, but
        into series no longer exposed.
        """
        with _families_lock:
            if not self._registered:
                return
            self._registered = False
            families = self._families
            families.in_use.discard(self._values)
            if self._values:
                for metric in families.metrics.values():
                    metric.remove(*self._values)
            elif _families.get(self.registry) is families:
                for metric in families.metrics.values():
                    self.registry.unregister(metric)
                del _families[self.registry]
