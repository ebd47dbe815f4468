# SPDX-License-Identifier: Apache-2.0
"""``LMCacheConnectorV1Impl``: lmcache behind vLLM's ``KVConnectorBase_V1`` (vLLM 0.26-0.33).

vLLM builds the connector twice: once in the scheduler (``KVConnectorRole.SCHEDULER``) and once
in every worker (``KVConnectorRole.WORKER``).
With tensor parallelism or the default multiprocess executor these live in different processes.
Two classes construct ``LMCacheConnectorV1Impl(vllm_config, role, parent)`` and delegate to it:
vLLM's in-tree ``LMCacheConnectorV1`` (imported through
``lmcache.integration.vllm.vllm_v1_adapter``) and our :mod:`lmcache_vllm.connector`.
It holds a :class:`~lmcache_vllm.scheduler.side.SchedulerSide` or a
:class:`~lmcache_vllm.worker.side.WorkerSide`, whose module docstrings walk through each step.
With several KV cache groups (vLLM's hybrid KV cache manager) the worker holds a
:class:`~lmcache_vllm.worker.grouped.GroupedWorkerSide`, one ``WorkerSide`` per attention group
(Mamba states beside them, :mod:`lmcache_vllm.worker.mamba_states`), and loads are asynchronous
so that a failed one is reported per request
(:mod:`lmcache_vllm.scheduler.async_loads`); on a vLLM that cannot take that report, nothing is
loaded for several groups.
The two sides talk through the plain data of :mod:`lmcache_vllm.connector_metadata`.

vLLM's in-tree wrapper forwards neither ``reset_cache``, nor the connector stats, nor
``handle_preemptions``, nor ``shutdown``.
When ``parent`` is that wrapper, this class attaches them to it
(:func:`lmcache_vllm.in_tree.adopt_in_tree_wrapper`), so the in-tree name gets every feature.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import TYPE_CHECKING, Any

from lmcache.cache_engine import LMCacheEngine
from lmcache_vllm.connector_metadata import (
    LMCacheConnectorMetadata,
    LoadSpec,
    ReqMeta,
    SaveSpec,
    WorkerStats,
)
from lmcache_vllm.extra_config import extra_config_overrides, load_lmcache_config
from lmcache_vllm.kv_groups import kv_groups
from lmcache_vllm.lookup_sockets import engine_key
from lmcache_vllm.scheduler.async_loads import NO_FAILED_RECVING, AsyncLoadsSchedulerSide
from lmcache_vllm.scheduler.side import SchedulerSide
from lmcache_vllm.utils import calculate_local_rank_and_world_size, get_vllm_torch_dev
from lmcache_vllm.vllm_types import SchedulerOutput, SchedulerRequest, VllmConfig
from lmcache_vllm.worker.grouped import GroupedWorkerSide
from lmcache_vllm.worker.kv_registration import check_kv_cache_groups
from lmcache_vllm.worker.rank_failures import PIPELINE_LOADS_OFF
from lmcache_vllm.worker.side import WorkerSide

if TYPE_CHECKING:
    import torch

__all__ = [
    "LMCacheConnectorMetadata",
    "LMCacheConnectorV1Impl",
    "LoadSpec",
    "ReqMeta",
    "SaveSpec",
    "WorkerStats",
    "extra_config_overrides",
    "live_engines",
    "load_lmcache_config",
]

logger = logging.getLogger(__name__)
#: The start-up line goes through vLLM's ``vllm`` logger, whose handler prints vLLM's INFO lines
#: (``lmcache_vllm``'s own logger prints nothing unless the application configured logging).
BANNER_LOGGER = logging.getLogger("vllm.lmcache_vllm")

_LIVE: list[weakref.ref[LMCacheEngine]] = []
_LIVE_LOCK = threading.Lock()


def _add_live(engine: LMCacheEngine) -> None:
    with _LIVE_LOCK:
        _LIVE[:] = [ref for ref in _LIVE if ref() is not None]
        _LIVE.append(weakref.ref(engine))


def live_engines() -> list[LMCacheEngine]:
    """Worker-side ``LMCacheEngine`` objects of this process that are not closed, oldest first
    (for tests, demos, debugging)."""
    with _LIVE_LOCK:
        engines = [ref() for ref in _LIVE]
    return [e for e in engines if e is not None and not e._closed]


def log_start_line(vllm_config: VllmConfig, *, is_worker: bool) -> bool:
    """Log lmcache's one start-up line for this process (:func:`lmcache.banner.log_banner`).

    The device is ``<kind>:<local rank>`` on a GPU worker (the device vLLM gives that rank),
    the device kind on the scheduler side and ``cpu`` on vLLM's CPU build. Never raises.
    """
    from lmcache.banner import log_banner

    try:
        import vllm

        version = str(getattr(vllm, "__version__", "unknown"))
    except ImportError:
        version = "not installed"
    device = "cpu"
    try:
        device, _ = get_vllm_torch_dev()
        if is_worker and device != "cpu":
            device = f"{device}:{calculate_local_rank_and_world_size(vllm_config)[0]}"
    except Exception:  # a start-up line never stops the engine
        logger.debug("lmcache: no device index for the start-up line", exc_info=True)
    return log_banner("vLLM", version, "lmcache-vllm", device, log=BANNER_LOGGER)


class LMCacheConnectorV1Impl:
    """Both sides of the lmcache connector; see the module docstring.

    Args:
        vllm_config: vLLM's ``VllmConfig``.
        role: ``KVConnectorRole.SCHEDULER`` or ``KVConnectorRole.WORKER``.
        parent: The ``KVConnectorBase_V1`` delegating to this object (source of the bound
            connector metadata).
    """

    def __init__(self, vllm_config: VllmConfig, role: object, parent: Any) -> None:
        self._parent = parent
        self._role_name = getattr(role, "name", str(role))
        self.is_scheduler = self._role_name == "SCHEDULER"
        kv_cache_config = getattr(parent, "_kv_cache_config", None)
        # several groups only through our own class, which implements vLLM's SupportsHMA
        native = parent is None or getattr(type(parent), "_lmcache_native", False)
        check_kv_cache_groups(kv_cache_config, supports_hma=native)
        self.config = load_lmcache_config(vllm_config)
        self.engine_key = engine_key(vllm_config)
        pc = vllm_config.parallel_config
        world = int(pc.tensor_parallel_size) * int(getattr(pc, "pipeline_parallel_size", 1))
        self.rank = int(getattr(pc, "rank", 0))
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | GroupedWorkerSide | None = None
        groups = kv_groups(kv_cache_config, int(vllm_config.cache_config.block_size))
        # several groups: loads are asynchronous, failures reported per request, where vLLM
        # takes that report (our class tells: ``_lmcache_failed_recving``)
        self.async_loads = len(groups) > 1 and bool(
            getattr(type(parent), "_lmcache_failed_recving", False)
        )
        if self.is_scheduler:
            _, local_world = calculate_local_rank_and_world_size(vllm_config)
            side = AsyncLoadsSchedulerSide if self.async_loads else SchedulerSide
            self.scheduler = side(vllm_config, self.config, world, local_world, kv_cache_config)
            if len(groups) > 1 and not self.async_loads and self.scheduler.loads_enabled:
                self.scheduler.loads_enabled = False  # a failed load could not be recomputed
                logger.warning(NO_FAILED_RECVING, len(groups))
            pp = int(getattr(pc, "pipeline_parallel_size", 1))
            if pp > 1 and self.scheduler.loads_enabled:  # no stage could learn of another's
                self.scheduler.loads_enabled = False  # failed load in time (rank_failures)
                logger.warning(PIPELINE_LOADS_OFF, pp)
        elif len(groups) > 1:  # vLLM's hybrid KV cache manager: one stream per group
            self.worker = GroupedWorkerSide(
                vllm_config,
                self.config,
                self.engine_key,
                world,
                self.rank,
                self._metadata,
                _add_live,
                groups,
                async_loads=self.async_loads,
            )
        else:
            self.worker = WorkerSide(
                vllm_config,
                self.config,
                self.engine_key,
                world,
                self.rank,
                self._metadata,
                _add_live,
            )
        if parent is not None and not getattr(type(parent), "_lmcache_native", False):
            from lmcache_vllm.in_tree import adopt_in_tree_wrapper

            adopt_in_tree_wrapper(parent, self)
        log_start_line(vllm_config, is_worker=not self.is_scheduler)
        logger.info(
            "lmcache connector (%s) for engine %s: chunk_size=%d layerwise=%s",
            self._role_name,
            self.engine_key,
            self.config.chunk_size,
            self.config.use_layerwise,
        )

    def _metadata(self) -> object:
        return self._parent._get_connector_metadata() if self._parent is not None else None

    def _scheduler_side(self) -> SchedulerSide:
        if self.scheduler is None:
            raise RuntimeError("lmcache: a scheduler-side method was called on a worker connector")
        return self.scheduler

    def _worker_side(self) -> WorkerSide | GroupedWorkerSide:
        if self.worker is None:
            raise RuntimeError("lmcache: a worker-side method was called on a scheduler connector")
        return self.worker

    @property
    def lmcache_engine(self) -> LMCacheEngine | None:
        """The worker's cache engine (``None`` on the scheduler or before registration)."""
        return self.worker.lmcache_engine if self.worker is not None else None

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(
        self, request: SchedulerRequest, num_computed_tokens: int
    ) -> int | None:
        """Tokens lmcache loads beyond ``num_computed_tokens`` (vLLM's in-tree wrapper adds the
        ``load_async=False`` flag); ``None`` while a disk / remote lookup is in flight (vLLM
        asks again at a later step)."""
        return self._scheduler_side().get_num_new_matched_tokens(request, num_computed_tokens)

    def loads_async(self, num_matched: int | None) -> bool:
        """vLLM's ``load_async`` flag for a hit of ``num_matched`` tokens: ``True`` for a hit
        with several KV cache groups on a vLLM with ``failed_recving``."""
        return bool(num_matched) and self.scheduler is not None and self.async_loads

    def update_state_after_alloc(
        self, request: SchedulerRequest, num_external_tokens: int, blocks: object = None
    ) -> None:
        """``blocks``: vLLM's ``KVCacheBlocks`` of the request (an asynchronous load writes
        them; vLLM's in-tree wrapper does not pass them, and never has several groups)."""
        side = self._scheduler_side()
        if isinstance(side, AsyncLoadsSchedulerSide):
            side.update_state_after_alloc(request, num_external_tokens, blocks)
        else:
            side.update_state_after_alloc(request, num_external_tokens)

    def update_connector_output(
        self, finished_recving: set[str] | None, failed_recving: set[str] | None
    ) -> None:
        """The workers' report of asynchronous loads (vLLM's ``KVConnectorOutput``)."""
        side = self.scheduler
        if isinstance(side, AsyncLoadsSchedulerSide):
            side.update_connector_output(finished_recving or (), failed_recving or ())

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> LMCacheConnectorMetadata:
        return self._scheduler_side().build_connector_meta(scheduler_output)

    def request_finished(
        self, request: SchedulerRequest, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``(False, None)``: vLLM frees the blocks at once; the workers' saves of them finish
        copying before any later step can rewrite them (see
        :mod:`lmcache_vllm.worker.save_queue`)."""
        self._scheduler_side().request_finished(request, block_ids)
        return False, None

    def request_finished_all_groups(
        self, request: SchedulerRequest, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """:meth:`request_finished` with the blocks of every KV cache group (vLLM's
        ``SupportsHMA``)."""
        self._scheduler_side().request_finished_all_groups(request, block_ids)
        return False, None

    def get_kv_events(self) -> list[Any]:
        """No KV events are published."""
        return []

    def reset_cache(self) -> bool:
        """Drop this engine's chunks on every worker rank (``reset_prefix_cache(
        reset_connector=True)``); other models' chunks in the same process stay."""
        if self.scheduler is not None:
            return self.scheduler.reset_cache()
        if self.worker is not None:
            self.worker._clear()
        return True

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker_side().register_kv_caches(kv_caches)

    def bind_connector_metadata(self, metadata: object) -> None:
        if self.worker is not None:
            self.worker.bind(metadata)

    def handle_preemptions(self, metadata: object) -> None:
        if self.worker is not None:
            self.worker.handle_preemptions(metadata)

    def start_load_kv(self, forward_context: object, **kwargs: Any) -> None:
        self._worker_side().start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker_side().wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self._worker_side().save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        self._worker_side().wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """``(None, None)``: nothing is held for lmcache (saves fence block reuse instead,
        asynchronous loads are reported by :meth:`get_transfer_results`, which vLLM calls
        instead where it has them); finished requests' leases are released here."""
        if self.worker is not None:
            self.worker.get_finished(finished_req_ids)
        return None, None

    def get_transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """:meth:`get_finished` (leases of finished requests), then the requests whose
        asynchronous load is complete and those of them whose load failed (vLLM's
        ``finished_recving`` and ``failed_recving``)."""
        worker = self.worker
        if worker is None:
            return set(), set()
        worker.get_finished(finished_req_ids)
        if isinstance(worker, GroupedWorkerSide):
            return worker.take_transfer_results()
        return set(), set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors() if self.worker is not None else set()

    def take_stats(self) -> dict[str, float] | None:
        """Counters since the last call (``None`` when nothing happened)."""
        if self.scheduler is not None:
            return self.scheduler.take_stats()
        return self.worker.take_stats() if self.worker is not None else None

    def shutdown(self) -> None:
        """Stop lookups and queued saves; the stored chunks stay for later engines."""
        if self.scheduler is not None:
            self.scheduler.close()
        if self.worker is not None:
            self.worker.shutdown()
