# SPDX-License-Identifier: Apache-2.0
"""Every feature through vLLM's in-tree name ``LMCacheConnectorV1`` too.

LMCache users select vLLM's in-tree wrapper with ``"kv_connector": "LMCacheConnectorV1"``.
It lives in ``vllm/distributed/kv_transfer/kv_connector/v1/lmcache_connector.py``.
The wrapper builds our :class:`~lmcache_vllm.vllm_v1_adapter.LMCacheConnectorV1Impl` and hands
itself as ``parent``.
It does not forward everything, in vLLM 0.26 and 0.32 alike:

- ``reset_cache``: without it, ``reset_prefix_cache(reset_connector=True)`` leaves lmcache full.
- the connector stats and the Prometheus counters.
- ``handle_preemptions``.
- ``shutdown``: without it, a shut-down engine leaves its queued saves unfinished, its lookup
  socket bound and its cache engine open until garbage collection.

The wrapper also picks its CUDA-graph mode from ``extra_config["use_layerwise"]`` alone.
It misses a layerwise mode set by ``lmcache.use_layerwise``, ``LMCACHE_USE_LAYERWISE`` or the
YAML file.

The wrapper is no ``SupportsHMA`` connector, and no hook of ours can make it one: vLLM turns its
hybrid KV cache manager off for it (sliding-window layers then keep the whole context), refuses
``--no-disable-hybrid-kv-cache-manager`` with it, and cannot start Mamba hybrids with it.
``kv_connector`` ``LMCacheConnector`` (or the module path ``lmcache_vllm.connector``) selects our
class, which keeps the manager on (:mod:`lmcache_vllm.kv_groups`); the adapter's error for
several groups under the wrapper names it.
This module fills these gaps:

- :func:`adopt_in_tree_wrapper` binds the per-instance methods on the wrapper object that built
  us (``reset_cache``, ``get_kv_connector_stats``, ``handle_preemptions``, ``shutdown``).
- :func:`patch_in_tree_class` gives the wrapper *class* our ``build_kv_connector_stats``,
  ``build_prom_metrics`` and ``requires_piecewise_for_cudagraph``.
  vLLM calls these on the class in its front-end process, where no connector instance exists.
  So our ``vllm.general_plugins`` entry point (:mod:`lmcache_vllm.plugin`) calls it in every
  vLLM process.

This module imports no other module of the adapter at import time, and never the adapter
itself, so the adapter can import it.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["adopt_in_tree_wrapper", "patch_in_tree_class", "use_layerwise_for"]

logger = logging.getLogger(__name__)

_IN_TREE_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector"


def use_layerwise_for(extra_config: dict[str, Any] | None) -> bool:
    """Whether lmcache runs layerwise for this ``kv_connector_extra_config``.

    The setting may come from the YAML file, ``LMCACHE_USE_LAYERWISE``, ``lmcache.use_layerwise``
    or ``use_layerwise`` in the extra config.
    A config that does not load counts as ``False`` here, because the connector reports the error
    when it is built.
    """
    from lmcache.config import load_config
    from lmcache_vllm.extra_config import extra_config_overrides

    try:
        return bool(load_config(overrides=extra_config_overrides(extra_config)).use_layerwise)
    except Exception:
        return False


def patch_in_tree_class() -> bool:
    """Give vLLM's in-tree ``LMCacheConnectorV1`` class lmcache's class-level hooks
    (idempotent). Returns whether the class was found."""
    try:
        import importlib

        module = importlib.import_module(_IN_TREE_MODULE)
    except Exception:  # another vLLM version, or vLLM absent
        return False
    cls = getattr(module, "LMCacheConnectorV1", None)
    if cls is None or getattr(cls, "_lmcache_patched", False):
        return cls is not None

    def build_kv_connector_stats(_cls: type, data: dict[str, Any] | None = None) -> Any:
        from lmcache_vllm.stats import LMCacheKVConnectorStats

        return LMCacheKVConnectorStats(data=dict(data)) if data else LMCacheKVConnectorStats()

    def build_prom_metrics(
        _cls: type,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        from lmcache_vllm.stats import LMCachePromMetrics

        return LMCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def requires_piecewise_for_cudagraph(_cls: type, extra_config: dict[str, Any]) -> bool:
        return use_layerwise_for(extra_config)

    cls.build_kv_connector_stats = classmethod(build_kv_connector_stats)
    cls.build_prom_metrics = classmethod(build_prom_metrics)
    cls.requires_piecewise_for_cudagraph = classmethod(requires_piecewise_for_cudagraph)
    cls._lmcache_patched = True
    return True


def adopt_in_tree_wrapper(parent: Any, impl: Any) -> None:
    """Bind ``impl``'s ``reset_cache``, stats, ``handle_preemptions`` and ``shutdown`` on the
    in-tree wrapper object ``parent`` (which does not forward them)."""

    def get_kv_connector_stats() -> Any:
        data = impl.take_stats()
        if data is None:
            return None
        from lmcache_vllm.stats import LMCacheKVConnectorStats

        return LMCacheKVConnectorStats(data=data)

    def handle_preemptions(kv_connector_metadata: Any) -> None:
        impl.handle_preemptions(kv_connector_metadata)

    parent.reset_cache = impl.reset_cache
    parent.get_kv_connector_stats = get_kv_connector_stats
    parent.handle_preemptions = handle_preemptions
    parent.shutdown = impl.shutdown  # the base class's is a no-op
    patch_in_tree_class()
