# SPDX-License-Identifier: Apache-2.0
"""lmcache as SGLang's ``UnifiedCacheLinker`` (SGLang 0.5.23+).

Load it with::

    --enable-unified-cache-external-linker --unified-cache-external-linker-backend dynamic
    --unified-cache-external-linker-config '{"linker": "LMCacheLinker",
        "linker_module_path": "lmcache_sglang.linker",
        "linker_extra_config": {"max_local_cpu_size": 4, "config_file": "lmcache.yaml"}}'

``linker_extra_config`` holds lmcache config keys (and ``config_file``); ``LMCACHE_*`` and
``LMCACHE_CONFIG_FILE`` apply as everywhere. SGLang's ``UnifiedRadixCache`` drives the linker:

- **lookup** (``match_prefix``): the pages of the device-uncached tail are named by SGLang's
  page hashes (chained over the tokens, seeded with the request's ``extra_key``, which carries
  the LoRA adapter, and ``cache_salt``); lmcache keys them with the model fingerprint and rank
  (:mod:`lmcache_sglang.page_store`) and returns every stored prefix length, in pages.
- **load** (``init_load_back``): the hit pages are leased and checksum-verified *now*; a page
  that went missing or fails its checksum refuses the load (SGLang frees the slots and
  recomputes). On a CUDA pool, pages stored from it carry the sum the GPU computed at store:
  they are copied into the request's private slots now, all layers at once, and verified on the
  GPU in that same pass (a page that fails is never written, is dropped from the CPU tier, and
  refuses the load); SGLang's ``LayerWiseLoadCounter`` then completes at once. Other pages (a
  CPU pool, ``checksum: false``, pages read from disk or Redis) are verified on the host when
  leased, and the load is queued: ``start_layer_wise_loading`` hands the batch to a load thread
  that writes layer after layer into the request's private slots and completes the counter,
  which the attention layers wait on (layerwise).
- **offload** (write-through of inserted nodes): queued to an offload thread that copies the
  pages out and stores them (asynchronous); SGLang collects completions through
  ``num_completed_offloads`` / ``pop_completed_offload``. An offload completes once its pages
  are in the CPU tier and written to the disk / remote tiers (the offload thread waits for those
  writes), so what SGLang saw offloaded survives the SGLang process.
- **tiers**: every tier lmcache is configured with (``local_cpu``, ``local_disk``,
  ``remote_url``): lookups span CPU -> disk -> remote, and a load reads pages found only below
  the CPU tier into host memory, verified, when it leases them
  (:class:`~lmcache_sglang.page_store.PageStore`).
- ``cancel_queued_load``, ``reset`` (quiesce; the stored pages stay, so a flushed radix tree is
  refilled from lmcache) and ``close``.

Only full-attention KV pools (MHA, MLA) are cached: a model whose cache has other components
(sliding window, Mamba; :func:`~lmcache_sglang.hicache_pools.refuse_hybrid_linker`) or a KV pool
lmcache cannot read (DeepSeek V4) stops start-up with an error naming them (the HiCache backend
stores SWA and Mamba pools), and a lookup or offload that involves another pool is a miss. Any lmcache error in a hook is a miss (logged), never a request
error: lookups return no hit, loads are refused before they start, offloads report failure.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lmcache.devices import get_backend
from lmcache.gpu_connector import CreateGPUConnector
from lmcache.gpu_connector.interface import ChunkTransfer, TransferSpec
from lmcache.metrics import LMCacheMetrics
from lmcache.tiers import process_cpu_tier
from lmcache_sglang.hicache_pools import refuse_hybrid_linker
from lmcache_sglang.hook_config import (
    hook_config,
    log_start_line,
    model_facts,
    tp_rank_and_size,
)
from lmcache_sglang.kv_pools import build_metadata, device_pool_layers
from lmcache_sglang.page_store import HeldPages, PageStore
from lmcache_sglang.sglang_types import CacheInitParams

try:  # SGLang's interface; this module is only imported by SGLang's linker factory.
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
    from sglang.srt.mem_cache.unified_cache.unified_cache_linker import (
        LayerWiseLoadCounter,
        UnifiedCacheLinker,
    )
except ImportError as exc:  # pragma: no cover - depends on the installed engine
    raise ImportError(
        "lmcache_sglang.linker needs SGLang 0.5.23 or newer (UnifiedCacheLinker); found "
        f"none: {exc}. Install sglang, or use the HiCache backend on older SGLang."
    ) from exc

__all__ = ["LMCacheLinker", "build_page_store"]

logger = logging.getLogger(__name__)

LOWER_TIER_FLUSH_SECONDS = 30.0
"""Longest an offload (or ``close``) waits for its disk / remote writes to land."""


def build_page_store(
    server_args: object,
    params: CacheInitParams,
    extra_config: Mapping[str, Any] | None,
    *,
    hook: str,
    config_path: str | None = None,
    ignore: tuple[str, ...] = (),
) -> PageStore:
    """A :class:`PageStore` over SGLang's device KV pool (``params``: ``CacheInitParams``).

    Raises:
        ConfigError: bad lmcache configuration.
        KVLayoutError: a KV pool lmcache cannot read.
    """
    config = hook_config(extra_config, hook=hook, path=config_path, ignore=ignore)
    page_size = int(params.page_size)
    kvcache = params.token_to_kv_pool_allocator.get_kvcache()
    layers = device_pool_layers(kvcache, page_size)
    group = getattr(params, "attn_tp_cache_group", None) or getattr(params, "tp_cache_group", None)
    rank, size = tp_rank_and_size(group)
    facts = model_facts(server_args)
    metadata = build_metadata(
        layers,
        model_name=facts.model_name,
        page_size=page_size,
        world_size=size,
        rank=rank,
        model_revision=facts.model_revision,
        quantization=facts.quantization,
        kv_cache_dtype=facts.kv_cache_dtype,
        model_digest=facts.model_digest,
    )
    connector = CreateGPUConnector(
        config, metadata, layers.engine_info(page_size), layers.layout_hints
    )
    metrics = LMCacheMetrics(labels={"engine": "sglang", "hook": hook, "rank": str(rank)})
    namespace = (
        f"pp{getattr(params, 'pp_rank', 0)}of{getattr(params, 'pp_size', 1)}"
        f"/cp{getattr(params, 'attn_cp_rank', 0)}of{getattr(params, 'attn_cp_size', 1)}"
    )
    return PageStore(
        config, metadata, connector, process_cpu_tier(config, metrics), metrics, namespace
    )


@dataclass
class _QueuedLoad:
    """A load waiting for ``start_layer_wise_loading``: ``held`` pages still to copy into
    ``slots`` (none when the pages were copied and verified at ``load``)."""

    rid: str
    held: HeldPages
    slots: torch.Tensor


class LMCacheLinker(UnifiedCacheLinker):  # type: ignore[misc]  # SGLang is untyped here
    """SGLang ``UnifiedCacheLinker`` over lmcache's tiers (see the module docstring).

    Constructed by SGLang as ``LMCacheLinker(server_args, params, components=...,
    extra_config=..., forward_stream=...)``.

    Raises:
        ConfigError: bad ``linker_extra_config`` / ``LMCACHE_*`` settings.
        KVLayoutError: SGLang's KV pool is not one lmcache reads.
    """

    def __init__(
        self,
        server_args: object,
        params: CacheInitParams,
        *,
        components: object = None,
        extra_config: Mapping[str, Any] | None = None,
        forward_stream: Any = None,
    ) -> None:
        refuse_hybrid_linker(components)
        self.forward_stream = forward_stream
        self.page_size = int(params.page_size)
        self.store = build_page_store(server_args, params, extra_config, hook="linker_extra_config")
        kvcache = params.token_to_kv_pool_allocator.get_kvcache()
        self.pools: dict[Any, object] = {PoolName.KV: kvcache}
        # the pool's device backend: offloads wait for the forward's events where it has streams
        device = str(getattr(kvcache, "device", "cpu"))
        self._backend = get_backend(device)
        self.num_layers = self.store.metadata.num_layers
        self.layer_done_counter = LayerWiseLoadCounter(self.num_layers)
        self._queued: dict[str, _QueuedLoad] = {}
        self._lock = threading.Lock()
        self._load_queue: queue.Queue[tuple[int, list[_QueuedLoad]] | None] = queue.Queue()
        self._offload_queue: queue.Queue[tuple[list[str], torch.Tensor, list[Any]] | None] = (
            queue.Queue()
        )
        self._offload_results: queue.Queue[bool] = queue.Queue()
        # verified loads of all layers run on a stream of their own: the forward in flight
        # on the scheduler's streams does not delay them
        self._verify_stream = (
            self._backend.new_stream(torch.device(device)) if self._backend.has_streams else None
        )
        self.stats = {
            "lookup_pages": 0,
            "loaded_pages": 0,
            "offloaded_pages": 0,
            "errors": 0,
            "refused_loads": 0,
        }
        self._threads = [
            threading.Thread(target=self._load_loop, name="lmcache-sglang-load", daemon=True),
            threading.Thread(target=self._offload_loop, name="lmcache-sglang-offload", daemon=True),
        ]
        for t in self._threads:
            t.start()
        log_start_line("UnifiedCacheLinker", getattr(kvcache, "device", "cpu"))
        md = self.store.metadata
        logger.info(
            "lmcache linker ready: model=%s rank=%d/%d layers=%d kv_width=%d dtype=%s page=%d",
            md.model_name,
            md.worker_id,
            md.world_size,
            md.num_layers,
            md.kv_width,
            md.kv_dtype,
            self.page_size,
        )

    # -- helpers --------------------------------------------------------------------------

    def _kv_only(self, transfers: list[PoolTransfer]) -> PoolTransfer | None:
        """The KV transfer, or ``None`` when another pool is involved (not cached by lmcache)."""
        if len(transfers) != 1 or transfers[0].name != PoolName.KV:
            return None
        kv = transfers[0]
        return kv if kv.keys else None

    def _miss(self, what: str, exc: BaseException) -> None:
        self.stats["errors"] += 1
        logger.warning("lmcache linker: %s failed (%r); treating it as a miss.", what, exc)

    # -- lookup / load --------------------------------------------------------------------

    def lookup(self, rid: str, transfers: list[PoolTransfer]) -> list[int]:
        """Every restorable prefix length in pages (1..n for n stored leading pages)."""
        try:
            kv = self._kv_only(transfers)
            if kv is None:
                return []
            hit = self.store.prefix_pages(list(kv.keys or []))
            self.stats["lookup_pages"] += hit
            return list(range(1, hit + 1))
        except Exception as exc:
            self._miss(f"lookup of {rid}", exc)
            return []

    def load(self, rid: str, transfers: list[PoolTransfer]) -> bool:
        """Lease and verify the pages now; queue the copy. ``False`` refuses the load.

        Pages whose device sums the connector verifies are copied now, verified in the same
        pass (:meth:`_copy_verified`); the others are copied layer by layer once the batch
        starts.
        """
        held: HeldPages | None = None
        try:
            kv = self._kv_only(transfers)
            if kv is None or kv.device_indices is None:
                return False
            keys = list(kv.keys or [])
            held = self.store.hold(keys)
            if len(held) < len(keys):
                held.release()
                return False
            slots = kv.device_indices.to("cpu", torch.int64)
            self.store.slot_spec(slots, len(keys))  # validates the slot count
            if self.store.checks_at_load(held):
                copied, held = held, HeldPages([])
                if not self._copy_verified(rid, copied, slots):
                    return False
            with self._lock:
                if rid in self._queued:
                    raise RuntimeError(f"a load for request {rid} is already queued")
                self._queued[rid] = _QueuedLoad(rid, held, slots)
            return True
        except Exception as exc:
            if held is not None:
                held.release()
            self._miss(f"load of {rid}", exc)
            return False

    def _copy_verified(self, rid: str, held: HeldPages, slots: torch.Tensor) -> bool:
        """Copy ``held`` into ``slots`` now, all layers, verified on the device (and release it).

        Only a load that ``load`` still refuses lets SGLang recompute: a layerwise load found
        bad after its forward makes SGLang abort the request instead. ``False``: a page failed
        its sum (never written, dropped from the CPU tier), so the load is refused.
        """
        try:
            with self._backend.use_stream(self._verify_stream):  # None: the current stream
                landed = self.store.load(held, slots)
        finally:
            held.release()
        if landed < len(held):
            self.stats["refused_loads"] += 1
            logger.warning(
                "lmcache linker: %d of %d pages of request %s landed before one failed its "
                "checksum; the load is refused (SGLang recomputes these tokens).",
                landed,
                len(held),
                rid,
            )
            return False
        self.stats["loaded_pages"] += landed
        return True

    def start_layer_wise_loading(self) -> int:
        with self._lock:
            batch, self._queued = list(self._queued.values()), {}
        if not batch:
            return -1
        index = int(self.layer_done_counter.update_producer())
        self._load_queue.put((index, batch))
        return index

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        return bool(self.layer_done_counter.finish(counter_index))

    def cancel_queued_load(self, rid: str) -> bool:
        with self._lock:
            load = self._queued.pop(rid, None)
        if load is None:
            return False
        load.held.release()
        return True

    def _write_layer(self, layer: int, chunks: list[ChunkTransfer], spec: TransferSpec) -> None:
        """Copy one layer of the batch's pages into SGLang's slots."""
        connector = self.store.connector
        connector.to_gpu_layer(layer, chunks, spec)  # type: ignore[attr-defined]
        connector.synchronize()

    def _load_batch(self, index: int, batch: list[_QueuedLoad]) -> None:
        ps = self.page_size
        batch = [load for load in batch if load.held.leases]  # the others are in place
        chunks: list[ChunkTransfer] = []
        for load in batch:
            base = len(chunks)
            chunks += [
                ChunkTransfer((base + i) * ps, (base + i + 1) * ps, lease.tensor)
                for i, lease in enumerate(load.held.leases)
            ]
        spec = TransferSpec(torch.cat([load.slots for load in batch])) if batch else None
        for layer in range(self.num_layers):
            if spec is not None:
                self._write_layer(layer, chunks, spec)
            self.layer_done_counter.complete(index, layer)
        self.stats["loaded_pages"] += len(chunks)
        metrics = self.store.metrics
        metrics.loaded_chunks.inc(len(chunks))
        metrics.loaded_bytes.inc(sum(c.buffer.nbytes for c in chunks))

    def _load_loop(self) -> None:
        while True:
            task = self._load_queue.get()
            try:
                if task is None:
                    return
                index, batch = task
                try:
                    self._load_batch(index, batch)
                except BaseException as exc:
                    # Slots are partly written: SGLang aborts these requests (finish() False).
                    self.stats["errors"] += 1
                    logger.exception("lmcache linker: layerwise load failed")
                    self.layer_done_counter.fail(index, exc)
                finally:
                    for load in batch:
                        load.held.release()
            finally:
                self._load_queue.task_done()

    # -- offload --------------------------------------------------------------------------

    def offload(self, transfers: list[PoolTransfer], session_id: str | None = None) -> bool:
        """Queue the pages for storing; ``False`` when they cannot be cached."""
        try:
            kv = self._kv_only(transfers)
            if kv is None or kv.device_indices is None:
                return False
            keys = list(kv.keys or [])
            slots = kv.device_indices.to("cpu", torch.int64)
            if slots.numel() != len(keys) * self.page_size:
                return False
            ready = self.record_offload_ready() if self._backend.has_streams else []
            self._offload_queue.put((keys, slots, ready))
            return True
        except Exception as exc:
            self._miss("offload", exc)
            return False

    def _offload_loop(self) -> None:
        while True:
            task = self._offload_queue.get()
            try:
                if task is None:
                    return
                keys, slots, ready = task
                try:
                    for event in ready:
                        event.synchronize()
                    ok = self.store.store(keys, slots) == len(keys)
                    if ok:
                        self.stats["offloaded_pages"] += len(keys)
                        # Write-through below the CPU tier is queued: wait for it here (off
                        # the scheduler thread), so a completed offload survives the process.
                        self.store.flush(LOWER_TIER_FLUSH_SECONDS)
                except Exception as exc:
                    self._miss("offload", exc)
                    ok = False
                self._offload_results.put(ok)
            finally:
                self._offload_queue.task_done()

    def num_completed_offloads(self) -> int:
        return self._offload_results.qsize()

    def pop_completed_offload(self) -> bool:
        return self._offload_results.get_nowait()

    # -- lifecycle ------------------------------------------------------------------------

    def reset(self) -> None:
        """Quiesce transfers and drop queued work; stored pages stay (a flush refills from them)."""
        with self._lock:
            queued, self._queued = list(self._queued.values()), {}
        for load in queued:
            load.held.release()
        self._load_queue.join()
        self._offload_queue.join()
        while True:
            try:
                self._offload_results.get_nowait()
            except queue.Empty:
                break
        self.layer_done_counter.reset()

    def close(self) -> None:
        self.reset()
        self._load_queue.put(None)
        self._offload_queue.put(None)
        for t in self._threads:
            t.join(timeout=30)
        logger.info("lmcache linker stats: %s", self.stats)
        self.store.flush(LOWER_TIER_FLUSH_SECONDS)
        self.store.connector.close()
