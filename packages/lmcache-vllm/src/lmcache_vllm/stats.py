# SPDX-License-Identifier: Apache-2.0
"""lmcache's numbers in vLLM's connector stats (log line) and Prometheus registry.

Workers return :class:`LMCacheKVConnectorStats` from ``get_kv_connector_stats``; vLLM ships it
to the logger process, aggregates it over workers and steps (``aggregate``), logs ``reduce()``
and feeds it to :class:`LMCachePromMetrics` (counters ``vllm:lmcache_*``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

__all__ = ["COUNTERS", "LMCacheKVConnectorStats", "LMCachePromMetrics"]

COUNTERS: dict[str, str] = {
    "loaded_tokens": "Tokens loaded from lmcache into vLLM's KV cache.",
    "expected_load_tokens": "Tokens lmcache was asked to load.",
    "failed_load_tokens": "Tokens that failed to load (vLLM recomputed them).",
    "stored_tokens": "Tokens newly stored into lmcache.",
    "load_seconds": "Seconds spent loading KV from lmcache.",
    "save_seconds": "Seconds spent saving KV to lmcache.",
    "num_loads": "Request loads performed.",
    "num_saves": "Request saves performed.",
    "expired_leases": "Lookup hits whose leased chunks were released unused after the timeout.",
    "scheduler_failures": "Scheduler-side lmcache failures turned into misses (never errors).",
    "skipped_requests": "Requests neither stored nor loaded: their KV cannot be keyed safely "
    "(e.g. prompt embeddings).",
    "checksum_failures": "Chunks that failed verification in any tier (treated as misses).",
    "tier_errors": "Tier operations that failed or timed out (treated as misses).",
    "tier_timeouts": "Disk/remote reads abandoned after tier_timeout seconds without progress "
    "(treated as misses; also counted in tier_errors).",
    "lookup_timeouts": "Lookups of a worker rank that missed their deadline (treated as misses).",
    "disk_hit_chunks": "Chunks read from the local disk tier.",
    "remote_hit_chunks": "Chunks read from the remote (Redis/Valkey) tier.",
    "dropped_writes": "Disk/remote writes dropped because the write queue was full.",
}
"""Counter keys of the stats payload and their Prometheus documentation."""


@dataclass
class LMCacheKVConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """Summed counters (plain floats: serialisable) over an interval."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTERS, 0.0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            if key in COUNTERS:
                self.data[key] = float(self.data.get(key, 0.0)) + float(value)
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        return {
            "lmcache loaded tokens": int(d.get("loaded_tokens", 0)),
            "lmcache failed load tokens": int(d.get("failed_load_tokens", 0)),
            "lmcache stored tokens": int(d.get("stored_tokens", 0)),
            "lmcache load time (ms)": round(float(d.get("load_seconds", 0.0)) * 1e3, 3),
            "lmcache save time (ms)": round(float(d.get("save_seconds", 0.0)) * 1e3, 3),
            "lmcache skipped requests": int(d.get("skipped_requests", 0)),
            "lmcache scheduler failures": int(d.get("scheduler_failures", 0)),
            "lmcache disk hit chunks": int(d.get("disk_hit_chunks", 0)),
            "lmcache remote hit chunks": int(d.get("remote_hit_chunks", 0)),
            "lmcache tier errors": int(d.get("tier_errors", 0)),
            "lmcache tier timeouts": int(d.get("tier_timeouts", 0)),
        }

    def is_empty(self) -> bool:
        return not any(float(v) for v in self.data.values())


class LMCachePromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """Counters ``vllm:lmcache_<key>`` (``<key>`` from :data:`COUNTERS`), per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {
            key: create_metric_per_engine(
                self._counter_cls(
                    name=f"vllm:lmcache_{key}", documentation=doc, labelnames=labelnames
                ),
                self.per_engine_labelvalues,
            )
            for key, doc in COUNTERS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            per_engine = self.counters.get(key)
            if per_engine is not None and float(value) > 0:
                per_engine[engine_idx].inc(float(value))
