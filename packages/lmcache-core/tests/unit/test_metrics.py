# SPDX-License-Identifier: Apache-2.0
"""LMCacheMetrics: counters count, render() exposes them, instances stay apart."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.parser import text_string_to_metric_families

from lmcache.metrics import LMCacheMetrics

COUNTERS = [
    "lookup_requests",
    "lookup_tokens",
    "hit_tokens",
    "stored_bytes",
    "loaded_bytes",
    "stored_chunks",
    "loaded_chunks",
    "evicted_chunks",
    "failed_allocations",
    "checksum_failures",
    "tier_errors",
]
HISTOGRAMS = ["store_seconds", "retrieve_seconds"]


def samples(metrics: LMCacheMetrics) -> dict[str, float]:
    """Parse render() back into {sample name: value}."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            if not sample.labels or set(sample.labels) == {"le"}:
                key = sample.name + (f"{{le={sample.labels['le']}}}" if sample.labels else "")
                out[key] = sample.value
    return out


def test_attribute_types() -> None:
    m = LMCacheMetrics()
    for name in COUNTERS:
        assert isinstance(getattr(m, name), Counter)
    for name in HISTOGRAMS:
        assert isinstance(getattr(m, name), Histogram)


def test_counters_increment_and_render() -> None:
    m = LMCacheMetrics()
    for i, name in enumerate(COUNTERS, start=1):
        getattr(m, name).inc(i)
    m.store_seconds.observe(0.002)
    m.store_seconds.observe(0.3)
    m.retrieve_seconds.observe(0.004)
    text = m.render().decode()
    parsed = samples(m)
    for i, name in enumerate(COUNTERS, start=1):
        assert f"lmcache_{name}_total" in text
        assert parsed[f"lmcache_{name}_total"] == i
        assert m.value(name) == i
    assert parsed["lmcache_store_seconds_count"] == 2
    assert parsed["lmcache_store_seconds_sum"] == pytest.approx(0.302)
    assert parsed["lmcache_store_seconds_bucket{le=0.0025}"] == 1
    assert parsed["lmcache_retrieve_seconds_count"] == 1
    assert m.value("store_seconds") == 2
    assert all(line.startswith(("#", "lmcache_")) for line in text.splitlines())


def test_instances_do_not_share_a_registry() -> None:
    a, b = LMCacheMetrics(), LMCacheMetrics()
    assert a.registry is not b.registry
    a.hit_tokens.inc(5)
    assert a.value("hit_tokens") == 5
    assert b.value("hit_tokens") == 0
    assert samples(b)["lmcache_hit_tokens_total"] == 0


def test_explicit_registry() -> None:
    reg = CollectorRegistry()
    m = LMCacheMetrics(reg)
    m.tier_errors.inc()
    assert m.registry is reg
    assert reg.get_sample_value("lmcache_tier_errors_total") == 1
    with pytest.raises(ValueError):  # prometheus refuses a second set of the same names
        LMCacheMetrics(reg)


def test_value_rejects_unknown_names() -> None:
    with pytest.raises(KeyError):
        LMCacheMetrics().value("registry")
