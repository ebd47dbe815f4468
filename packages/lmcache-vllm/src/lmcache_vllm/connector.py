# SPDX-License-Identifier: Apache-2.0
"""``LMCacheConnectorV1``: the connector class vLLM loads by module path or plugin name.

Use either::

    --kv-transfer-config '{"kv_connector": "LMCacheConnectorV1",
                           "kv_connector_module_path": "lmcache_vllm.connector",
                           "kv_role": "kv_both"}'

or, with the ``vllm.general_plugins`` entry point installed (:mod:`lmcache_vllm.plugin`),
``{"kv_connector": "LMCacheConnector", "kv_role": "kv_both"}``. Both support vLLM's hybrid KV
cache manager (``SupportsHMA``: models with sliding-window layers keep it on). vLLM's in-tree name
``LMCacheConnectorV1`` (without a module path) reaches the same implementation through
``lmcache.integration.vllm.vllm_v1_adapter``. With several KV cache groups, on a vLLM that
takes failed loads per request (``KVConnectorTransferResults.failed_recving``, found by feature),
hits load asynchronously (``load_async=True``) and a failed load is reported per request
(:mod:`lmcache_vllm.scheduler.async_loads`). This class is a thin delegate to
:class:`lmcache_vllm.vllm_v1_adapter.LMCacheConnectorV1Impl`; unlike vLLM's in-tree wrapper it
forwards everything; the in-tree wrapper gets the hooks it lacks from :mod:`lmcache_vllm.in_tree`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

try:  # vLLM's marker of connectors that take its hybrid KV cache manager's per-group blocks
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:  # pragma: no cover - a vLLM without the hybrid manager's connector API

    class SupportsHMA:  # type: ignore[no-redef]
        pass


try:  # vLLM's per-request report of failed loads (asynchronous loads with several KV groups)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # pragma: no cover - vLLM 0.26: block-level load errors only
    KVConnectorTransferResults = None

from lmcache_vllm.vllm_v1_adapter import LMCacheConnectorV1Impl


def _takes_failed_recving() -> bool:
    """Whether this vLLM takes failed loads per request: ``KVConnectorTransferResults`` with
    ``failed_recving``, returned by ``get_transfer_results``."""
    fields = getattr(KVConnectorTransferResults, "__dataclass_fields__", {})
    return "failed_recving" in fields and hasattr(KVConnectorBase_V1, "get_transfer_results")


FAILED_RECVING = _takes_failed_recving()
"""This vLLM takes failed loads per request (vLLM 0.32 has it, 0.26 not)."""

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["LMCacheConnector", "LMCacheConnectorV1"]


class LMCacheConnectorV1(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """vLLM KV connector backed by lmcache (see the module docstring).

    It implements vLLM's ``SupportsHMA``, so vLLM keeps its hybrid KV cache manager on: with a
    sliding-window model each KV cache group keeps only the blocks its layers attend to
    (:mod:`lmcache_vllm.kv_groups`).
    """

    _lmcache_native = True  # the implementation needs no hooks attached (lmcache_vllm.in_tree)
    _lmcache_failed_recving = FAILED_RECVING  # several groups: asynchronous loads

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        from lmcache_vllm.in_tree import use_layerwise_for

        return use_layerwise_for(extra_config)

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._impl = LMCacheConnectorV1Impl(vllm_config, role, self)

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._impl.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._impl.bind_connector_metadata(connector_metadata)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._impl.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._impl.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._impl.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self._impl.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        self._impl.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._impl.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """``KVConnectorTransferResults``: asynchronous loads completed and failed (only with
        several KV cache groups; vLLMs without the class never call this)."""
        recving, failed = self._impl.get_transfer_results(finished_req_ids)
        assert KVConnectorTransferResults is not None
        return KVConnectorTransferResults(finished_recving=recving, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._impl.get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        data = self._impl.take_stats()
        if data is None:
            return None
        from lmcache_vllm.stats import LMCacheKVConnectorStats

        return LMCacheKVConnectorStats(data=data)

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        from lmcache_vllm.stats import LMCacheKVConnectorStats

        return LMCacheKVConnectorStats(data=dict(data)) if data else LMCacheKVConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        from lmcache_vllm.stats import LMCachePromMetrics

        return LMCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        self._impl.shutdown()

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        matched = self._impl.get_num_new_matched_tokens(request, num_computed_tokens)
        return matched, self._impl.loads_async(matched)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._impl.update_state_after_alloc(request, num_external_tokens, blocks)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._impl.update_connector_output(
            getattr(connector_output, "finished_recving", None),
            getattr(connector_output, "failed_recving", None),
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._impl.build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._impl.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._impl.request_finished_all_groups(request, block_ids)

    def reset_cache(self) -> bool | None:
        return self._impl.reset_cache()


LMCacheConnector = LMCacheConnectorV1
"""The name the ``vllm.general_plugins`` entry point registers (``"LMCacheConnector"``)."""
