# SPDX-License-Identifier: Apache-2.0
"""Worker side of the lmcache connector: moves KV between vLLM's pages and lmcache.

vLLM keeps one worker-side connector per worker process. Per step:

1. :meth:`WorkerSide.handle_preemptions` runs first. It fences the blocks of preempted requests.
   It also saves chunks that drafts of speculative decoding completed in a finished request's
   last step, before vLLM rewrites their freed blocks.
2. :meth:`WorkerSide.bind` orders this step's writes of vLLM's pages after the reads of the
   saves queued so far. On CUDA the compute stream waits on the device for each save's gather;
   the host waits only until those gathers are enqueued. It then notes this step's saves and
   releases stale leases (a preempted request keeps its lease until it resumes or ends).
3. :meth:`WorkerSide.start_load_kv` loads each request's hit from the chunks this rank leased at
   lookup (:mod:`lmcache_vllm.worker.lookup_leases`). On CUDA the copies go on a load stream and
   the compute stream waits for them on the device. The host waits for them only in
   ``wait_for_save``, after the forward is enqueued. On the CPU each load is one synchronous
   ``LMCacheEngine.retrieve``. Tokens that do not arrive make their blocks load errors, and no
   save stores KV computed over them (:mod:`~lmcache_vllm.worker.failed_loads`), on any
   tensor-parallel rank (:mod:`~lmcache_vllm.worker.rank_failures`).
4. At the forward's last layer (:meth:`WorkerSide.save_kv_layer`) the planning of this step's
   saves is queued on the copy thread: chunk keys, host buffers, one copy plan for all of them.
5. :meth:`WorkerSide.wait_for_save` queues the step's one copy of every planned save on the
   :class:`~lmcache_vllm.worker.save_queue.SaveQueue` and returns at once. On CUDA the copy waits
   on the device for the step's compute. The commit thread waits for the bytes to reach the
   host, then publishes them when vLLM's thread is likely waiting on the GPU
   (:class:`~lmcache_vllm.worker.save_queue.QuietGate`).
6. :meth:`WorkerSide.get_finished` releases finished requests' leases.

A lookup runs on the lookup server's thread (:mod:`lmcache_vllm.worker.lookup_server`). On CUDA
it starts the hit's copy to the device and checks its checksums there before it answers
(:mod:`~lmcache_vllm.worker.hit_prefetch`). Loads are in :mod:`~lmcache_vllm.worker.loads`,
batched saves in :mod:`~lmcache_vllm.worker.batched_saves`, layerwise loads and saves in
:mod:`~lmcache_vllm.worker.layerwise_step`.

Loads and saves share one transfer lock. A load waits for a save that is *enqueueing* its copy at
that moment: the connector's planning state is not shared between concurrent calls. A save's
planning runs outside the lock. The only connector state it shares with a load, the pinned
slot-index ring, has a lock of its own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

import torch

from lmcache.cache_engine import LMCacheEngine
from lmcache.config import LMCacheConfig
from lmcache.devices import DeviceBackend, get_backend
from lmcache_vllm.connector_metadata import (
    ENGINE_COUNTERS,
    LMCacheConnectorMetadata,
    WorkerStats,
)
from lmcache_vllm.lookup_wire import LookupQuery
from lmcache_vllm.vllm_types import VllmConfig
from lmcache_vllm.worker.batched_saves import BatchedSaves
from lmcache_vllm.worker.counters import WorkerCounters
from lmcache_vllm.worker.hit_prefetch import HitPrefetcher
from lmcache_vllm.worker.kv_registration import build_engine, order_caches
from lmcache_vllm.worker.layerwise_step import LayerwiseStep
from lmcache_vllm.worker.loads import RequestLoads
from lmcache_vllm.worker.lookup_leases import LookedUp, LookupLeases
from lmcache_vllm.worker.lookup_server import LookupServer
from lmcache_vllm.worker.rank_failures import RankFailures
from lmcache_vllm.worker.save_queue import (
    SaveQueue,
    UnpublishedSaves,
)

__all__ = ["SECOND_ENGINE_ERROR", "WorkerSide"]

logger = logging.getLogger(__name__)

SECOND_ENGINE_ERROR = (
    "lmcache: a second vLLM engine in this process registered its KV caches with the first "
    "engine's lmcache connector (vLLM keeps one worker-side KV connector per process, so two "
    "engines alive at once in one process would share it and load KV into the wrong engine's "
    "pages). Run one engine per process: shut the first engine down before creating the next, "
    "or use vLLM's default multiprocess mode (do not set VLLM_ENABLE_V1_MULTIPROCESSING=0)."
)


class WorkerSide:
    """Worker-side state of the lmcache connector (see the module docstring).

    Args:
        vllm_config: vLLM's ``VllmConfig``.
        config: lmcache configuration.
        engine_key: Names this engine instance (lookup socket).
        world_size: Ranks holding shards; ``rank`` is this worker's.
        get_metadata: Returns the connector metadata bound for this step.
        on_engine: Called with each ``LMCacheEngine`` built (the adapter's registry of live
            engines).
        block_size: vLLM's block size of these layers (default ``cache_config.block_size``).
        group_tag: One of several KV cache groups (:mod:`lmcache_vllm.worker.grouped`): goes
            into the fingerprint of its chunks.
        serve_lookups: Start this rank's lookup server (a grouped worker serves its groups').
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        config: LMCacheConfig,
        engine_key: str,
        world_size: int,
        rank: int,
        get_metadata: Callable[[], object],
        on_engine: Callable[[LMCacheEngine], None] | None = None,
        block_size: int | None = None,
        group_tag: str = "",
        serve_lookups: bool = True,
    ) -> None:
        self._vllm_config = vllm_config
        self.config = config
        self.chunk_size = config.chunk_size
        self.block_size = block_size or int(vllm_config.cache_config.block_size)
        self._group_tag, self._serve_lookups = group_tag, serve_lookups
        self.engine_key = engine_key
        self.world_size = world_size
        self.rank = rank
        self._get_metadata = get_metadata
        self._on_engine = on_engine
        self.lmcache_engine: LMCacheEngine | None = None
        self._registered: list[torch.Tensor] = []
        self._lookup_server: LookupServer | None = None
        self._layer_ids: dict[str, int] = {}
        self._counters = WorkerCounters()
        self._engine_seen: dict[str, float] = {}  # engine counters already reported
        # one lock per direction: a store and a load are enqueued at once, each on its own
        # streams and staging (PCIe carries both ways together)
        self._load_lock = threading.Lock()
        self._store_lock = threading.Lock()
        self._layerwise: LayerwiseStep | None = None  # built with the caches (device)
        self._backend: DeviceBackend = get_backend("cpu")  # the caches' device, once registered
        self._bound: object = None  # the metadata bind() last ran for
        self._leases = LookupLeases()
        self._saves = SaveQueue(f"lmcache-save-rank{rank}")
        self._unpublished = UnpublishedSaves(self.chunk_size)
        self.prefetcher = HitPrefetcher(self.chunk_size, config.use_layerwise)
        self._loads = RequestLoads(
            self.chunk_size,
            self.block_size,
            config.use_layerwise,
            self._load_lock,
            self._counters,
            self.prefetcher,
        )
        self._batched = BatchedSaves(
            self._saves,
            self._unpublished,
            self._store_lock,
            self.chunk_size,
            self.block_size,
            self._counters,
            self._loads.failed,
        )
        # a stream of a grouped worker loads asynchronously: vLLM combines the ranks' reports
        self._ranks = RankFailures(self._loads.failed, self.block_size, exchanges=not group_tag)

    # ------------------------------------------------------------------ registration

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Build the metadata, connector, cache engine and lookup server from vLLM's caches.

        Raises:
            KVLayoutError: no caches, or a layout no connector handles.
            RuntimeError: a second engine of this process registers other caches.
        """
        names, caches = order_caches(kv_caches)
        if self.lmcache_engine is not None:
            if len(caches) == len(self._registered) and all(
                a.data_ptr() == b.data_ptr() for a, b in zip(caches, self._registered, strict=True)
            ):
                return  # the same caches again
            raise RuntimeError(SECOND_ENGINE_ERROR)
        engine, kv_format = build_engine(
            self._vllm_config,
            self.config,
            names,
            caches,
            world_size=self.world_size,
            rank=self.rank,
            labels={"engine": self.engine_key, "rank": str(self.rank)},
            block_size=self.block_size,
            group_tag=self._group_tag,
        )
        first = caches[0]
        self.lmcache_engine = engine
        self._registered = caches
        # the device backend of the caches: the worker's streams and events go through it
        self._backend = get_backend(first.device)
        self._layerwise = LayerwiseStep(
            self._load_lock,
            self._store_lock,
            self._saves,
            first.device,
            self._loads.fail_whole,
            self._backend,
            on_chunks_rejected=self._loads.chunks_rejected,
            failed=self._loads.failed,
        )
        self._layer_ids = {n: i for i, n in enumerate(names)}
        self._loads.asynchronous = self._backend.has_streams
        self.prefetcher.attach(self._layerwise.copy_stream)
        self._batched.attach(engine, self._backend, first.device, self._layerwise.store_stream)
        if self._on_engine is not None:
            self._on_engine(engine)
        if self._serve_lookups:
            self._lookup_server = LookupServer(
                self.engine_key, self.rank, self._lookup, self._clear
            )
        logger.info(
            "lmcache: registered %d layers %s on %s (%s)%s, lookup socket %s",
            len(caches),
            tuple(first.shape),
            first.device.type,
            kv_format,
            f" as {self._group_tag}" if self._group_tag else "",
            self._lookup_server.path if self._lookup_server else "of the grouped worker",
        )

    # ------------------------------------------------------------------ lookups (server thread)

    def _lookup(self, query: LookupQuery) -> int:
        engine = self.lmcache_engine
        if engine is None or self._leases.has_ended(query.req_id):
            return 0  # ended meanwhile (a query that waited): nothing to read or lease
        reused = self._leases.reuse(query.req_id, len(query.tokens), query.salt)
        if reused is not None:
            return reused
        extra = dict(query.extra_keys) or None
        hit = engine.lookup_and_lease(query.tokens, salt=query.salt, extra_keys=extra)
        if hit.num_tokens < len(query.tokens) and self._unpublished.wait_for(
            query.salt, query.tokens, hit.num_tokens, hurry=self._saves.gate.hurry
        ):
            hit.release()  # a save of the missing chunks was queued: look again
            hit = engine.lookup_and_lease(query.tokens, salt=query.salt, extra_keys=extra)
        self.prefetcher.prefetch(engine, hit)
        self.prefetcher.verify(engine, hit)
        # what the hit's keys were made for (a snapshot: the load compares, then reuses them)
        looked = LookedUp.of(query.tokens, query.salt, extra) if hit.num_tokens else None
        self._leases.put(query.req_id, hit, len(query.tokens), query.salt, looked)
        return hit.num_tokens

    def _clear(self) -> None:
        """Drop this engine's chunks, after the saves queued so far (a reset is a reset)."""
        if not self._saves.wait(timeout=60.0):
            logger.warning("lmcache: saves still running at reset; chunks may reappear")
        if self.lmcache_engine is not None:
            self.lmcache_engine.clear()

    # ------------------------------------------------------------------ per step

    def _meta(self) -> LMCacheConnectorMetadata | None:
        meta = self._get_metadata()
        return meta if isinstance(meta, LMCacheConnectorMetadata) else None

    def bind(self, meta: object) -> None:
        """Start of a step, before anything writes vLLM's pages: finish the previous step's
        layerwise work, wait until queued saves have copied their pages (vLLM may reuse freed or
        preempted blocks from now on), release stale leases. A preempted request keeps its
        lease: asynchronous scheduling may have leased it again before this step binds."""
        self._bound = meta
        if self._layerwise is not None:  # the last step's, where its wait_for_save never came
            self._layerwise.finish(self._ranks.exchange)
        self._fence()
        self._batched.drop_planned()
        if not isinstance(meta, LMCacheConnectorMetadata):
            return
        self._loads.failed.begin_step(meta)  # after the last step's loads are known
        if not self.config.use_layerwise:
            self._batched.note(meta)
        expired = self._leases.expire()
        if expired:
            with self._counters.lock:
                self._counters.stats.expired_leases += expired

    def handle_preemptions(self, meta: object) -> None:
        """Fence the blocks of preempted requests, which are about to be reused.

        No save may still read them afterwards.
        Saves of requests that finished at the last step (``meta.finished``: chunks completed
        by accepted speculative tokens) read their freed blocks now.
        vLLM may rewrite those blocks next: it zeroes or copies blocks, then loads and computes.

        vLLM calls this first thing in every step, before preparing the step's inputs.
        With nothing preempted or finished it returns at once.
        The step's :meth:`bind`, right before the forward, orders the step's writes after the
        saves' reads anyway.
        Fencing here as well would make the step wait that much earlier for the last step's
        copies to be enqueued.
        """
        if isinstance(meta, LMCacheConnectorMetadata):
            if meta.finished:
                self._batched.save_finished(meta.finished)
            elif not meta.preempted:
                return
        self._fence()

    def _fence(self) -> None:
        """Order every later write of vLLM's pages after the reads of the saves queued so far:
        a short host wait until each queued copy is enqueued, then device-side waits of the
        compute stream (and the layerwise load stream) on the events after their gathers."""
        events = self._saves.wait_read(timeout=300.0)
        if events is None:
            logger.error("lmcache: queued saves did not read their pages within 300 s")
            return
        if not events or not self._registered:
            return
        device = self._registered[0].device
        backend = self._backend
        streams = [backend.current_stream(device)]
        if self._layerwise is not None and self._layerwise.load_stream is not None:
            streams.append(self._layerwise.load_stream)
        for event in events:
            for stream in streams:
                backend.wait_event(stream, event)

    def start_load_kv(self) -> None:
        """Load every request's hit: one batched retrieve each, or, layerwise, enqueue every
        layer now (prefetch; the forward waits per layer in :meth:`wait_for_layer_load`)."""
        raw = self._get_metadata()
        if raw is not self._bound:  # vLLM 0.26's in-tree wrapper does not forward the bind
            self.bind(raw)
        meta = self._meta()
        engine = self.lmcache_engine
        self._ranks.arm(meta)  # every rank exchanges, whatever happens here
        try:
            layerwise = self._loads.load_all(meta, engine, self._leases)
        finally:  # synchronous loads: every outcome is known, and no save is planned yet
            if self._layerwise is None or self._loads.synchronous:
                self._ranks.exchange()
        if layerwise and self._layerwise is not None and engine is not None:
            self._layerwise.start_loads(
                layerwise, engine.metadata.num_layers, whole=not self.config.use_layerwise
            )

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layerwise: order the forward's use of ``layer_name`` after its loads."""
        layer = self._layer_ids.get(layer_name)
        if layer is not None and self._layerwise is not None:
            self._layerwise.wait_layer(layer)

    def save_kv_layer(self, layer_name: str) -> None:
        """Layerwise: queue the copy of ``layer_name`` for every request saving this step.
        Batched: at the last layer (the forward is enqueued but for its head), queue the
        planning of this step's saves."""
        engine = self.lmcache_engine
        layer = self._layer_ids.get(layer_name)
        step = self._layerwise
        if not self.config.use_layerwise:
            if layer is not None and layer == len(self._layer_ids) - 1:
                self._batched.queue_plan()
            return
        if engine is None or layer is None or step is None:
            return
        if not step.saves_started:
            meta = self._meta()
            reqs = meta.requests if meta is not None else []
            step.plan_saves(engine, reqs, self.chunk_size, self.block_size, self._save_done)
        step.save_layer(layer)

    def _save_done(self, salt: str, tokens: list[int]) -> Callable[[int | None], None]:
        """Registers a save as unpublished; the callback publishes and counts it."""
        job = self._unpublished.add(salt, tokens)
        started = time.perf_counter()

        def _done(stored: int | None) -> None:
            self._unpublished.done(job)
            if stored is not None:
                self._counters.count_save(stored, time.perf_counter() - started)

        return _done

    def wait_for_save(self) -> None:
        """Queue the copy of this step's saves (planned during the forward) and return at
        once; finish this step's enqueued loads (their leases go, failed ones become load
        errors)."""
        if self._layerwise is not None:  # layerwise: queues this step's commits
            self._layerwise.finish(self._ranks.exchange)
        if not self.config.use_layerwise:
            self._batched.wait_for_save()

    def get_finished(self, finished_req_ids: Iterable[str]) -> None:
        """Release the leases of finished (or aborted) requests, also those a lookup still in
        flight for one of them takes later (:meth:`LookupLeases.finish`); nothing is ever reported
        as finished sending (blocks are freed at once: :meth:`bind` fences their reuse)."""
        ids = list(finished_req_ids)
        self._leases.finish(ids)
        self._loads.failed.end(ids)

    @property
    def held_leases(self) -> int:
        """Requests whose lookup hit this rank holds leased (until their load or end)."""
        return len(self._leases)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call."""
        return self._loads.take_errors()

    def take_stats(self) -> dict[str, float] | None:
        """Worker counters since the last call (``None`` when nothing happened)."""
        with self._counters.lock:
            stats, self._counters.stats = self._counters.stats, WorkerStats()
            out = stats.as_dict()
            engine = self.lmcache_engine
            if engine is not None:  # the tiers' counters, as deltas since the last report
                for name in ENGINE_COUNTERS:
                    value = engine.metrics.value(name)
                    out[name] = value - self._engine_seen.get(name, 0.0)
                    self._engine_seen[name] = value
        if not any(out.values()):
            return None
        return out

    def shutdown(self) -> None:
        """Finish queued saves, stop the lookup server, release every lease."""
        if not self._saves.close(timeout=60.0):
            logger.warning("lmcache: saves still running at shutdown; their chunks are dropped")
        self._batched.close()  # saves planned for a step that never ended
        if self._lookup_server is not None:
            self._lookup_server.close()
            self._lookup_server = None
        if self._layerwise is not None:
            self._layerwise.abort()
        self._leases.clear()
        if self.lmcache_engine is not None:
            self.lmcache_engine.close()  # the process-wide tier keeps the chunks
        self.lmcache_engine = None
        self._registered = []
