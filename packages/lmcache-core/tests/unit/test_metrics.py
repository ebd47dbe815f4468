# SPDX-License-Identifier: Apache-2.0
"""LMCacheMetrics: counters count, render() exposes them, instances stay apart."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
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
    with pytest.raises(ValueError, match="registry already has an instance with labels"):
        LMCacheMetrics(reg)  # a second set would count into the same series


def test_value_rejects_unknown_names() -> None:
    with pytest.raises(KeyError, match="'registry' is not an LMCacheMetrics metric attribute"):
        LMCacheMetrics().value("registry")


def labelled_samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    """Parse a registry's exposition into {(sample name, engine label): value}, buckets left out."""
    out: dict[tuple[str, str], float] = {}
    text = generate_latest(registry).decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "le" not in sample.labels:
                out[(sample.name, sample.labels.get("engine", ""))] = sample.value
    return out


def test_labelled_instances_share_a_registry() -> None:
    reg = CollectorRegistry()
    a = LMCacheMetrics(reg, labels={"engine": "a"})
    b = LMCacheMetrics(reg, labels={"engine": "b"})
    assert a.registry is b.registry is reg
    assert a.labels == {"engine": "a"}
    for i, name in enumerate(COUNTERS, start=1):
        getattr(a, name).inc(i)
        getattr(b, name).inc(10 * i)
    a.store_seconds.observe(0.01)
    b.store_seconds.observe(0.01)
    b.store_seconds.observe(0.02)
    parsed = labelled_samples(reg)
    for i, name in enumerate(COUNTERS, start=1):
        assert a.value(name) == i == parsed[(f"lmcache_{name}_total", "a")]
        assert b.value(name) == 10 * i == parsed[(f"lmcache_{name}_total", "b")]
        assert reg.get_sample_value(f"lmcache_{name}_total", {"engine": "b"}) == 10 * i
    assert a.value("store_seconds") == 1 and b.value("store_seconds") == 2
    assert parsed[("lmcache_store_seconds_count", "b")] == 2
    assert a.value("retrieve_seconds") == 0
    assert a.render() == b.render() == generate_latest(reg)
    # No unlabelled series next to the labelled ones.
    assert ("lmcache_hit_tokens_total", "") not in parsed


def test_label_names_are_sorted_and_every_metric_is_labelled() -> None:
    m = LMCacheMetrics(labels={"model": "m", "engine": "0"})
    m.hit_tokens.inc(3)
    m.retrieve_seconds.observe(0.2)
    for family in text_string_to_metric_families(m.render().decode()):
        for sample in family.samples:
            assert {"engine": "0", "model": "m"}.items() <= sample.labels.items(), sample
    assert m.registry.get_sample_value("lmcache_hit_tokens_total", m.labels) == 3
    assert m.value("hit_tokens") == 3 and m.value("retrieve_seconds") == 1
    assert isinstance(m.hit_tokens, Counter) and isinstance(m.retrieve_seconds, Histogram)


def test_shared_registry_conflicts_are_errors() -> None:
    reg = CollectorRegistry()
    a = LMCacheMetrics(reg, labels={"engine": "a"})
    with pytest.raises(ValueError, match="already has an instance with labels"):
        LMCacheMetrics(reg, labels={"engine": "a"})
    with pytest.raises(ValueError, match=r"label names \['engine'\], found labels \{'rank'"):
        LMCacheMetrics(reg, labels={"rank": "0"})
    with pytest.raises(ValueError, match="label names"):
        LMCacheMetrics(reg)
    a.hit_tokens.inc(7)
    a.unregister()
    a.unregister()  # idempotent
    assert reg.get_sample_value("lmcache_hit_tokens_total", {"engine": "a"}) is None
    again = LMCacheMetrics(reg, labels={"engine": "a"})  # the values are free again
    assert again.value("hit_tokens") == 0


def test_unlabelled_unregister_frees_the_names() -> None:
    reg = CollectorRegistry()
    m = LMCacheMetrics(reg)
    m.hit_tokens.inc(2)
    m.unregister()
    assert reg.get_sample_value("lmcache_hit_tokens_total") is None
    fresh = LMCacheMetrics(reg, labels={"engine": "x"})  # other label names now fine
    fresh.hit_tokens.inc()
    assert reg.get_sample_value("lmcache_hit_tokens_total", {"engine": "x"}) == 1


def test_foreign_lmcache_metrics_and_bad_labels() -> None:
    reg = CollectorRegistry()
    Counter("lmcache_tier_errors", "not ours", registry=reg)
    with pytest.raises(ValueError, match="did not create"):
        LMCacheMetrics(reg)
    assert reg.get_sample_value("lmcache_lookup_requests_total") is None  # rolled back
    with pytest.raises(ValueError, match="label name 'le'"):
        LMCacheMetrics(labels={"le": "x"})
    with pytest.raises(ValueError, match="label name '0bad'"):
        LMCacheMetrics(labels={"0bad": "x"})
    with pytest.raises(TypeError, match="expected a str"):
        LMCacheMetrics(labels={"engine": 0})  # type: ignore[dict-item]


def test_value_matches_the_registry_samples_per_instance() -> None:
    """``value`` reads the instance's own series; it equals what Prometheus exposes."""
    from prometheus_client import CollectorRegistry

    from lmcache.metrics import LMCacheMetrics

    registry = CollectorRegistry()
    a = LMCacheMetrics(registry, labels={"engine": "a"})
    b = LMCacheMetrics(registry, labels={"engine": "b"})
    a.checksum_failures.inc(3)
    b.checksum_failures.inc(5)
    for seconds in (0.001, 0.2, 7.0):
        a.store_seconds.observe(seconds)
    for m, labels in ((a, {"engine": "a"}), (b, {"engine": "b"})):
        assert m.value("checksum_failures") == registry.get_sample_value(
            "lmcache_checksum_failures_total", labels
        )
        assert m.value("store_seconds") == registry.get_sample_value(
            "lmcache_store_seconds_count", labels
        )
    assert (a.value("checksum_failures"), b.value("checksum_failures")) == (3, 5)
    assert (a.value("store_seconds"), b.value("store_seconds")) == (3, 0)
