# SPDX-License-Identifier: Apache-2.0
"""Worker side of the lmcache connector: moves KV between vLLM's pages and lmcache.

One per worker process (vLLM keeps one worker-side connector per process). Per step:

1. :meth:`WorkerSide.bind`: orders this step's writes of vLLM's pages after the reads of the
   saves queued so far (vLLM may now rewrite freed or preempted blocks): on CUDA the compute
   stream waits on the device for each save's gather, the host only until the gathers are
   enqueued; then notes this step's batched saves and releases leases of preempted requests and
   stale ones. Their planning (chunk keys, host buffers, one copy plan for all of them) is
   queued on the copy thread at the forward's last layer (:meth:`WorkerSide.save_kv_layer`),
   once vLLM's thread has enqueued the forward, and runs while the step computes. Earlier,
   first thing in the step, :meth:`WorkerSide.handle_preemptions` fences preempted requests'
   blocks and copies chunks of requests that finished at the last step whose tokens became
   known only after it (speculative decoding), before vLLM rewrites their freed blocks.
2. :meth:`WorkerSide.start_load_kv`: loads every request's hit from the chunks this rank leased
   at lookup (:mod:`lmcache_vllm.worker.lookup_leases`). On CUDA the copies are enqueued on a load stream
   and the compute stream waits for them on the device (batched: all layers at once;
   layerwise: in layer groups, :meth:`WorkerSide.wait_for_layer_load` orders each layer's
   compute after its group, :mod:`lmcache_vllm.worker.layerwise_step`); the host waits for them only
   in ``wait_for_save``, after the forward is enqueued. On the CPU, one synchronous
   ``LMCacheEngine.retrieve`` per request. Tokens that did not arrive make their blocks a load
   error (vLLM's ``get_block_ids_with_load_errors``).
3. :meth:`WorkerSide.wait_for_save`: queues the step's one copy of every planned save on the
   :class:`~lmcache_vllm.worker.save_queue.SaveQueue` and returns at once (on CUDA the copy is enqueued
   on a store stream after an event recorded after the step's compute, and the commit thread
   waits for it to reach the host, then publishes each request's chunks once vLLM's thread is
   likely waiting on the GPU: :class:`~lmcache_vllm.worker.save_queue.QuietGate`); layerwise,
   :meth:`WorkerSide.save_kv_layer` queues each layer's copy the same way.
4. :meth:`WorkerSide.get_finished`: releases finished requests' leases; nothing is held for
   lmcache, so nothing is reported as finished sending.

Loads and saves share one transfer lock: a load waits for a save *enqueueing* its copy at that
moment (the connector's planning state is not shared between concurrent calls; every transfer
has its own device staging buffer). A save's planning runs outside the lock: the only
connector state it shares with a load, the pinned slot-index ring, has a lock of its own.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from lmcache.cache_engine import LMCacheEngine
from lmcache.config import LMCacheConfig
from lmcache.devices import DeviceBackend, get_backend
from lmcache.gpu_connector import ChunkTransfer, TransferSpec
from lmcache_vllm.connector_metadata import (
    ENGINE_COUNTERS,
    LMCacheConnectorMetadata,
    ReqMeta,
    WorkerStats,
)
from lmcache_vllm.lookup_wire import LookupQuery
from lmcache_vllm.transfer.fused_plan import Prefetched
from lmcache_vllm.transfer.paged_connector import VLLMPagedConnector
from lmcache_vllm.transfer.transfer_plan import load_outcome, load_plan, skip_mask, slot_mapping
from lmcache_vllm.worker.kv_registration import build_engine, order_caches
from lmcache_vllm.worker.layerwise_step import LayerwiseStep, PendingSave, layer_groups
from lmcache_vllm.worker.lookup_leases import HeldHits, LookedUp
from lmcache_vllm.worker.lookup_server import LookupServer
from lmcache_vllm.worker.save_queue import (
    CommitJob,
    CopyJob,
    ReadFence,
    SaveQueue,
    UnpublishedSaves,
)

if TYPE_CHECKING:
    from lmcache.cache_engine import LayerwiseRetrieve, PlannedStore, StoreBatch
    from lmcache.held_hit import HeldHit

__all__ = ["SECOND_ENGINE_ERROR", "WorkerSide"]

logger = logging.getLogger(__name__)

SECOND_ENGINE_ERROR = (
    "lmcache: a second vLLM engine in this process registered its KV caches with the first "
    "engine's lmcache connector (vLLM keeps one worker-side KV connector per process, so two "
    "engines alive at once in one process would share it and load KV into the wrong engine's "
    "pages). Run one engine per process: shut the first engine down before creating the next, "
    "or use vLLM's default multiprocess mode (do not set VLLM_ENABLE_V1_MULTIPROCESSING=0)."
)


@dataclasses.dataclass(eq=False)
class _PlannedSave:
    """One request's batched save this step; ``job``: its :class:`UnpublishedSaves` id."""

    req: ReqMeta
    tokens: list[int]
    job: int
    planned: PlannedStore | None = None


@dataclasses.dataclass(eq=False)
class _StepSaves:
    """A step's batched saves: noted at bind, planned on the copy thread from the forward's
    last layer (``live``: those whose plan succeeded, ``batch``: their one copy), copied after
    ``wait_for_save``."""

    saves: list[_PlannedSave]
    live: list[_PlannedSave] = dataclasses.field(default_factory=list)
    batch: StoreBatch | None = None
    spec: TransferSpec | None = None
    queued: bool = False  # its plan job is on the copy thread

    @property
    def label(self) -> str:
        """Names the step's requests in the save queue's log lines."""
        ids = [save.req.req_id for save in self.saves]
        return ", ".join(ids[:4]) + (f" (+{len(ids) - 4} more)" if len(ids) > 4 else "")


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
    """

    def __init__(
        self,
        vllm_config: Any,
        config: LMCacheConfig,
        engine_key: str,
        world_size: int,
        rank: int,
        get_metadata: Callable[[], Any],
        on_engine: Callable[[LMCacheEngine], None] | None = None,
    ) -> None:
        self._vllm_config = vllm_config
        self.config = config
        self.chunk_size = config.chunk_size
        self.block_size = int(vllm_config.cache_config.block_size)
        self.engine_key = engine_key
        self.world_size = world_size
        self.rank = rank
        self._get_metadata = get_metadata
        self._on_engine = on_engine
        self.lmcache_engine: LMCacheEngine | None = None
        self._registered: list[torch.Tensor] = []
        self._lookup_server: LookupServer | None = None
        self._layer_ids: dict[str, int] = {}
        self._load_errors: set[int] = set()
        self._stats = WorkerStats()
        self._engine_seen: dict[str, float] = {}  # engine counters already reported
        self._stats_lock = threading.Lock()
        self._xfer_lock = threading.Lock()
        self._layerwise: LayerwiseStep | None = None  # built with the caches (device)
        self._backend: DeviceBackend = get_backend("cpu")  # the caches' device, once registered
        self._async_loads = False  # CUDA: batched loads are enqueued, not waited for
        self._prefetching = 0  # bytes of device copies of hits made ahead of their load
        self._bound: Any = None  # the metadata bind() last ran for
        self._held = HeldHits()
        self._planned: _StepSaves | None = None  # this step's saves, noted at bind
        self._saves = SaveQueue(f"lmcache-save-rank{rank}")
        self._unpublished = UnpublishedSaves(self.chunk_size)

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
        )
        first = caches[0]
        self.lmcache_engine = engine
        self._registered = caches
        # the device backend of the caches: the worker's streams and events go through it
        self._backend = get_backend(first.device)
        self._layerwise = LayerwiseStep(
            self._xfer_lock,
            self._saves,
            first.device,
            self._fail_whole_load,
            self._backend,
            on_chunks_rejected=self._chunks_rejected,
        )
        self._layer_ids = {n: i for i, n in enumerate(names)}
        self._async_loads = self._backend.has_streams
        if self._on_engine is not None:
            self._on_engine(engine)
        self._lookup_server = LookupServer(self.engine_key, self.rank, self._lookup, self._clear)
        logger.info(
            "lmcache: registered %d layers %s on %s (%s), lookup socket %s",
            len(caches),
            tuple(first.shape),
            first.device.type,
            kv_format,
            self._lookup_server.path,
        )

    # ------------------------------------------------------------------ lookups (server thread)

    def _lookup(self, query: LookupQuery) -> int:
        engine = self.lmcache_engine
        if engine is None or self._held.has_ended(query.req_id):
            return 0  # ended meanwhile (a query that waited): nothing to read or lease
        reused = self._held.reuse(query.req_id, len(query.tokens), query.salt)
        if reused is not None:
            return reused
        extra = dict(query.extra_keys) or None
        hit = engine.lookup_and_lease(query.tokens, salt=query.salt, extra_keys=extra)
        if hit.num_tokens < len(query.tokens) and self._unpublished.wait_for(
            query.salt, query.tokens, hit.num_tokens, hurry=self._saves.gate.hurry
        ):
            hit.release()  # a save of the missing chunks was queued: look again
            hit = engine.lookup_and_lease(query.tokens, salt=query.salt, extra_keys=extra)
        self._prefetch(engine, hit)
        self._verify(engine, hit)
        # what the hit's keys were made for (a snapshot: the load compares, then reuses them)
        looked = LookedUp.of(query.tokens, query.salt, extra) if hit.num_tokens else None
        self._held.put(query.req_id, hit, len(query.tokens), query.salt, looked)
        return hit.num_tokens

    def _verify(self, engine: LMCacheEngine, hit: HeldHit) -> None:
        """CUDA: check the hit's chunks against their stored checksums on the device now (in
        the prefetch's device copy, else through a scratch buffer) and cut the hit before the
        first bad one. vLLM is then promised only verified tokens: a bad chunk is a miss, not
        a load error (which vLLM's default ``kv_load_failure_policy`` turns into a failed
        request). The load verifies the bytes again as it scatters them."""
        connector = engine.gpu_connector
        lw = self._layerwise
        if (
            hit.num_tokens <= 0
            or lw is None
            or lw.copy_stream is None
            or not isinstance(connector, VLLMPagedConnector)
            or not connector.verifies_checksums
        ):
            return
        sums = hit.checksums()
        if all(s is None for s in sums):
            return
        size = self.chunk_size
        chunks = [
            ChunkTransfer(i * size, min((i + 1) * size, hit.num_tokens), t, checksum=s)
            for i, (t, s) in enumerate(zip(hit.tensors(), sums, strict=True))
        ]
        pre = hit.prefetched if isinstance(hit.prefetched, Prefetched) else None
        try:
            ok = connector.verify_chunks(chunks, lw.copy_stream, pre)
        except Exception as exc:  # the load verifies again: a failure here only costs time
            logger.warning("lmcache: could not verify a hit at lookup (%s)", exc)
            return
        if ok is not None:
            engine.cut_held_hit(hit, ok)

    prefetch_budget_bytes: int = 2 << 30
    """Device memory that hits copied ahead of their load may hold at once (CUDA)."""

    def _prefetch(self, engine: LMCacheEngine, hit: HeldHit) -> None:
        """CUDA: start copying a fresh hit to the device now, on the copy stream, so the load at
        the step's start only scatters it into vLLM's pages (the copy overlaps vLLM's scheduling
        and input preparation). Layerwise, the copy goes in the load's layer groups, each
        scattered as soon as its own copy is in. Skipped past :attr:`prefetch_budget_bytes`;
        never fails a lookup."""
        connector = engine.gpu_connector
        lw = self._layerwise
        if (
            not self._async_loads
            or hit.num_tokens <= 0
            or hit.prefetched is not None
            or lw is None
            or not isinstance(connector, VLLMPagedConnector)
        ):
            return
        nbytes = connector.chunk_nbytes(hit.num_tokens)
        with self._stats_lock:
            if self._prefetching + nbytes > self.prefetch_budget_bytes:
                return
            self._prefetching += nbytes
        try:
            tensors = hit.tensors()
            size = self.chunk_size
            chunks = [
                ChunkTransfer(i * size, min((i + 1) * size, hit.num_tokens), t)
                for i, t in enumerate(tensors)
            ]
            connector.check_chunks(
                chunks, TransferSpec(torch.empty(hit.num_tokens, dtype=torch.long))
            )
            groups = layer_groups(connector.num_layers) if self.config.use_layerwise else ()
            done = connector.prefetch(chunks, lw.copy_stream, groups)
        except Exception as exc:  # a device copy ahead of time is an optimisation only
            logger.debug("lmcache: no prefetch of a hit (%s)", exc)
            done = None
        if done is None:
            self._prefetch_freed(nbytes)
            return
        weakref.finalize(done.staging, self._prefetch_freed, nbytes)
        hit.prefetched = done

    def _prefetch_freed(self, nbytes: int) -> None:
        with self._stats_lock:
            self._prefetching -= nbytes

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

    def bind(self, meta: Any) -> None:
        """Start of a step, before anything writes vLLM's pages: finish the previous step's
        layerwise work, wait until queued saves have copied their pages (vLLM may reuse freed or
        preempted blocks from now on), release leases of preempted requests and stale ones."""
        self._bound = meta
        if self._layerwise is not None:
            self._layerwise.finish()
        self._fence()
        self._drop_planned()
        if not isinstance(meta, LMCacheConnectorMetadata):
            return
        self._plan_saves(meta)
        self._held.release(meta.preempted)
        expired = self._held.expire()
        if expired:
            with self._stats_lock:
                self._stats.expired_leases += expired

    def handle_preemptions(self, meta: Any) -> None:
        """Preempted requests' blocks are about to be reused: no save may still read them.
        Saves of requests that finished at the last step (``meta.finished``: chunks completed
        by accepted speculative tokens) read their freed blocks now, before vLLM may rewrite
        them (it zeroes or copies blocks next, then loads and computes).

        vLLM calls this first thing in every step, before preparing the step's inputs; with
        nothing preempted or finished it returns at once (the step's :meth:`bind`, right
        before the forward, orders the step's writes after the saves' reads: fencing here as
        well would make the step wait for the last step's copies to be enqueued that much
        earlier)."""
        if isinstance(meta, LMCacheConnectorMetadata):
            if meta.finished:
                self._save_finished(meta.finished)
            elif not meta.preempted:
                return
        self._fence()

    def _save_finished(self, reqs: list[ReqMeta]) -> None:
        """Queue one batched save of finished requests' chunks (their KV was written by the
        steps before this one); the caller fences, so the pages are read before this step
        writes any."""
        engine = self.lmcache_engine
        if engine is None or not self._registered:
            return
        saves = []
        for req in reqs:
            if req.save is not None:
                tokens = req.token_ids[: req.save.end]
                saves.append(_PlannedSave(req, tokens, self._unpublished.add(req.salt, tokens)))
        if not saves:
            return
        step = _StepSaves(saves, queued=True)
        self._saves.submit(step.label, partial(self._plan_job, engine, step))
        # CUDA: after every forward enqueued so far (the one that wrote this KV)
        ready = self._forward_event() if self._store_stream() is not None else None
        fence = ReadFence()
        self._saves.submit(step.label, self._save_job(step, ready, fence), fence)

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

    def _slot_mapping(self, req: ReqMeta, num_tokens: int) -> torch.Tensor:
        return slot_mapping(req.block_ids, self.block_size, num_tokens)

    def _mask(self, num_tokens: int, skip: int) -> torch.Tensor | None:
        """A save's mask; ``None`` (every chunk) when ``skip`` covers no whole chunk, which
        spares the engine building and checking one for most saves."""
        return skip_mask(num_tokens, skip, self.chunk_size) if skip >= self.chunk_size else None

    def _record_load(self, req: ReqMeta, loaded: torch.Tensor | None) -> None:
        outcome = load_outcome(req, loaded, self.block_size)
        with self._stats_lock:
            self._stats.expected_load_tokens += outcome.expected
            self._stats.loaded_tokens += outcome.loaded
            self._stats.failed_load_tokens += outcome.failed
            self._stats.num_loads += 1
        if outcome.bad_blocks:
            self._load_errors.update(outcome.bad_blocks)
            logger.warning(
                "lmcache: request %s loaded %d of %d tokens; blocks %s reported to vLLM as load "
                "errors",
                req.req_id,
                outcome.loaded,
                outcome.expected,
                outcome.bad_blocks,
            )

    def start_load_kv(self) -> None:
        """Load every request's hit: one batched retrieve each, or, layerwise, enqueue every
        layer now (prefetch; the forward waits per layer in :meth:`wait_for_layer_load`)."""
        raw = self._get_metadata()
        if raw is not self._bound:  # vLLM 0.26's in-tree wrapper does not forward the bind
            self.bind(raw)
        meta = self._meta()
        engine = self.lmcache_engine
        if meta is None or engine is None:
            return
        layerwise: list[tuple[ReqMeta, LayerwiseRetrieve, HeldHit | None]] = []
        for req in meta.requests:
            held, looked = self._held.take(req.req_id)
            if req.load is None:
                if held is not None:
                    held.release()
                continue
            started = self._load_one(engine, req, held, looked)
            if started is not None:
                layerwise.append((req, started, held))
        if layerwise and self._layerwise is not None:
            self._layerwise.start_loads(
                layerwise, engine.metadata.num_layers, whole=not self.config.use_layerwise
            )

    def _load_one(
        self,
        engine: LMCacheEngine,
        req: ReqMeta,
        held: HeldHit | None,
        looked: LookedUp | None = None,
    ) -> LayerwiseRetrieve | None:
        """Load ``req`` (batched), or return its layerwise retrieve for the caller to drive;
        the keys its lookup computed (``looked``) are reused where they match its tokens."""
        plan = load_plan(req, self.block_size, self.chunk_size)
        if plan is None:
            if held is not None:
                held.release()
            self._record_load(req, None)
            return None
        tokens, mask, transfer, _ = plan
        if held is not None and self.config.use_layerwise:
            self._prefetch(engine, held)  # not copied at lookup (budget): copy per layer group
        if held is not None and held.prefetched is not None:
            transfer = dataclasses.replace(transfer, staged=held.prefetched)
        extra = req.extra_keys or None
        known: list[bytes] = []
        if held is not None and looked is not None:
            known = looked.keys_for(held, tokens, req.salt, extra, self.chunk_size)
        started = time.perf_counter()
        loaded: torch.Tensor | None = None
        try:
            if self.config.use_layerwise or self._async_loads:
                retriever = engine.retrieve_layerwise(
                    tokens,
                    mask,
                    transfer,
                    salt=req.salt,
                    extra_keys=extra,
                    held=held,
                    known_keys=known,
                )
                full = torch.zeros(len(req.token_ids), dtype=torch.bool)
                lo = req.load.vllm_cached // self.chunk_size * self.chunk_size  # type: ignore[union-attr]
                full[lo : lo + retriever.num_hit_tokens] = True
                self._record_load(req, full)
                return retriever
            with self._xfer_lock:
                loaded = engine.retrieve(
                    tokens,
                    mask,
                    transfer,
                    salt=req.salt,
                    extra_keys=extra,
                    held=held,
                    known_keys=known,
                )
        except Exception:
            logger.exception("lmcache: load of request %s failed", req.req_id)
        if held is not None:
            held.release()
        with self._stats_lock:
            self._stats.load_seconds += time.perf_counter() - started
        self._record_load(req, loaded)
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layerwise: order the forward's use of ``layer_name`` after its loads."""
        layer = self._layer_ids.get(layer_name)
        if layer is not None and self._layerwise is not None:
            self._layerwise.wait_layer(layer)

    def _chunks_rejected(self, req: ReqMeta, loaded: torch.Tensor, lost: int) -> None:
        """Chunks of an enqueued load failed their checksum on the device: their blocks (and
        the rest of the load) become load errors, so vLLM recomputes them."""
        outcome = load_outcome(req, loaded, self.block_size)
        with self._stats_lock:
            self._stats.loaded_tokens -= lost
            self._stats.failed_load_tokens += lost
        self._load_errors.update(outcome.bad_blocks)
        logger.warning(
            "lmcache: request %s: %d loaded tokens failed their checksum; blocks %s reported "
            "to vLLM as load errors",
            req.req_id,
            lost,
            outcome.bad_blocks,
        )

    def _fail_whole_load(self, req: ReqMeta) -> None:
        load = req.load
        if load is not None:
            first, end = load.vllm_cached // self.block_size, -(-load.load_end // self.block_size)
            self._load_errors.update(req.block_ids[first:end])

    def save_kv_layer(self, layer_name: str) -> None:
        """Layerwise: queue the copy of ``layer_name`` for every request saving this step.
        Batched: at the last layer (the forward is enqueued but for its head), queue the
        planning of this step's saves."""
        engine = self.lmcache_engine
        layer = self._layer_ids.get(layer_name)
        lw = self._layerwise
        if not self.config.use_layerwise:
            if layer is not None and layer == len(self._layer_ids) - 1:
                self._queue_plan()
            return
        if engine is None or layer is None or lw is None:
            return
        if not lw.saves_started:
            meta = self._meta()
            saves = []
            for req in meta.requests if meta is not None else []:
                if req.save is None:
                    continue
                tokens = req.token_ids[: req.save.end]
                begin = partial(
                    engine.store_layerwise,
                    tokens,
                    self._mask(len(tokens), req.save.skip),
                    salt=req.salt,
                    extra_keys=req.extra_keys or None,
                )  # leases its buffers on the save thread, not in the forward
                slots = self._slot_mapping(req, len(tokens))
                saves.append(PendingSave(req, slots, begin, self._save_done(req.salt, tokens)))
            lw.start_saves(saves)
        lw.save_layer(layer)

    def _save_done(self, salt: str, tokens: list[int]) -> Callable[[int | None], None]:
        """Registers a save as unpublished; the callback publishes and counts it."""
        job = self._unpublished.add(salt, tokens)
        started = time.perf_counter()

        def _done(stored: int | None) -> None:
            self._unpublished.done(job)
            if stored is not None:
                self._count_save(stored, time.perf_counter() - started)

        return _done

    def _count_save(self, stored: int, seconds: float) -> None:
        with self._stats_lock:
            self._stats.stored_tokens += stored
            self._stats.num_saves += 1
            self._stats.save_seconds += seconds

    def _plan_saves(self, meta: LMCacheConnectorMetadata) -> None:
        """Batched mode: note this step's saves (a lookup of the same prompt waits for them
        from now on); their host side (chunk keys, host buffers, the connector's plan of one
        copy for all of them) is planned on the copy thread while the step computes their KV
        (:meth:`_queue_plan`), so that after the step only one copy is left to enqueue."""
        if self.lmcache_engine is None or self.config.use_layerwise:
            return
        saves = []
        for req in meta.requests:
            if req.save is not None:
                tokens = req.token_ids[: req.save.end]
                saves.append(_PlannedSave(req, tokens, self._unpublished.add(req.salt, tokens)))
        if saves:
            self._planned = _StepSaves(saves)

    def _queue_plan(self) -> None:
        """Queue the planning of this step's saves on the copy thread, once: at the forward's
        last layer (vLLM's thread has enqueued nearly all of the forward, so the planning's
        Python no longer competes with it for the GIL while the GPU could starve; it then
        waits on the GPU), else at ``wait_for_save`` (a forward whose layers do not call
        ``save_kv_layer``, e.g. inside a CUDA graph)."""
        step, engine = self._planned, self.lmcache_engine
        if step is None or step.queued or engine is None:
            return
        step.queued = True
        self._saves.submit(step.label, partial(self._plan_job, engine, step))

    def _plan_job(self, engine: LMCacheEngine, step: _StepSaves) -> None:
        """Copy thread: plan every save of ``step`` (one failing drops only that one), then
        their batch (:meth:`LMCacheEngine.batch_stores`: one connector call for all)."""
        stream = self._store_stream()
        empty = torch.empty(0, dtype=torch.long)
        spec = (
            TransferSpec(empty)
            if stream is None
            else TransferSpec(empty, stream=stream, deferred=True)
        )
        # device work of the planning (index uploads) goes where the copy will
        with self._backend.use_stream(stream):
            for save in step.saves:
                req = save.req
                assert req.save is not None
                try:
                    save.planned = engine.plan_store(
                        save.tokens,
                        self._mask(len(save.tokens), req.save.skip),
                        TransferSpec(self._slot_mapping(req, len(save.tokens))),
                        salt=req.salt,
                        extra_keys=req.extra_keys or None,
                        prepare=False,
                    )
                except Exception:
                    logger.exception("lmcache: save of request %s failed", req.req_id)
                    self._unpublished.done(save.job)
            live = [save for save in step.saves if save.planned is not None]
            stores = [save.planned for save in live if save.planned is not None]
            try:
                step.batch = engine.batch_stores(stores, spec)
            except BaseException:
                for save in live:
                    assert save.planned is not None
                    save.planned.abort()
                    self._unpublished.done(save.job)
                raise
        step.live, step.spec = live, spec

    def _store_stream(self) -> Any:
        """The worker's one store stream (CUDA caches), else ``None``."""
        if self._layerwise is None or not self._registered or not self._backend.has_streams:
            return None
        return self._layerwise.store_stream

    def _drop_planned(self) -> None:
        """Saves planned at the last bind whose ``wait_for_save`` never came: release their
        buffers (on the copy thread, after their plan job)."""
        step, self._planned = self._planned, None
        if step is not None:
            self._saves.submit(step.label, partial(self._drop_job, step))

    def _drop_job(self, step: _StepSaves) -> None:
        if step.batch is not None:
            step.batch.abort()
        for save in step.saves:
            if save.planned is not None:
                save.planned.abort()
            self._unpublished.done(save.job)

    def wait_for_save(self) -> None:
        """Queue the copy of this step's saves (planned during the forward) and return at
        once; finish this step's enqueued loads (their leases go, failed ones become load
        errors)."""
        if self._layerwise is not None:
            self._layerwise.finish()  # layerwise: queues this step's commits
        if self.config.use_layerwise:
            return
        self._queue_plan()
        step, self._planned = self._planned, None
        cuda = self._store_stream() is not None
        if step is None:
            if cuda and self._saves.gate.waiting:  # commits wait for a forward in flight
                self._saves.gate.forward_enqueued(self._forward_event())
            return
        ready = self._forward_event() if cuda else None
        if ready is not None:
            self._saves.gate.forward_enqueued(ready)
        fence = ReadFence()
        self._saves.submit(step.label, self._save_job(step, ready, fence), fence)

    def _forward_event(self) -> Any:
        """A CUDA event on vLLM's stream after the forward enqueued so far."""
        backend = self._backend
        return backend.event_after(backend.current_stream(self._registered[0].device))

    def _save_job(self, step: _StepSaves, ready: Any, fence: ReadFence) -> CopyJob:
        """The copy job of a step's planned saves (on CUDA it releases ``fence`` once vLLM's
        pages are read and returns before the bytes reach the host); it returns the commit
        job, which publishes each request's chunks."""

        def _copy() -> CommitJob | None:
            batch, spec, live = step.batch, step.spec, step.live
            if batch is None or spec is None:
                return None  # the plan failed (logged): nothing to copy
            started = time.perf_counter()
            copied: Any = None  # CUDA: the event after the copy to the host
            try:
                with self._xfer_lock:
                    if ready is None:
                        staged = batch.copy_out(spec)
                    else:
                        stream = spec.stream
                        backend = self._backend
                        backend.wait_event(stream, ready)  # after the step that wrote this KV

                        def _read() -> None:  # the gather is enqueued: pages may change after
                            fence.release(backend.event_after(stream))

                        with backend.use_stream(stream):
                            staged = batch.copy_out(dataclasses.replace(spec, on_engine_read=_read))
                            # blocking: the commit thread sleeps on it (a spinning wait
                            # would poll the driver, and burn a core, for a whole forward)
                            copied = backend.event_after(stream, blocking=True)
                        fence.release(copied)  # no-op when _read ran
            except BaseException:
                for save in live:
                    self._unpublished.done(save.job)
                raise

            def _commit() -> None:
                try:
                    if copied is not None:
                        self._backend.event_synchronize(copied)  # the bytes are on the host
                        self._saves.gate.wait()  # publish while vLLM's thread waits on the GPU
                except BaseException:
                    for st in staged:
                        st.abort()
                    for save in live:
                        self._unpublished.done(save.job)
                    raise
                for save, st in zip(live, staged, strict=True):
                    try:
                        stored = st.commit()
                    except Exception:
                        logger.exception("lmcache: save of request %s failed", save.req.req_id)
                        continue
                    finally:
                        self._unpublished.done(save.job)
                    self._count_save(stored, time.perf_counter() - started)

            return _commit

        return _copy

    def get_finished(self, finished_req_ids: Iterable[str]) -> None:
        """Release the leases of finished (or aborted) requests, also those a lookup still in
        flight for one of them takes later (:meth:`HeldHits.finish`); nothing is ever reported
        as finished sending (blocks are freed at once: :meth:`bind` fences their reuse)."""
        self._held.finish(finished_req_ids)

    @property
    def held_leases(self) -> int:
        """Requests whose lookup hit this rank holds leased (until their load or end)."""
        return len(self._held)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_stats(self) -> dict[str, float] | None:
        """Worker counters since the last call (``None`` when nothing happened)."""
        with self._stats_lock:
            stats, self._stats = self._stats, WorkerStats()
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
        if self._planned is not None:  # planned for a step that never ended
            self._drop_job(self._planned)
            self._planned = None
        if self._lookup_server is not None:
            self._lookup_server.close()
            self._lookup_server = None
        if self._layerwise is not None:
            self._layerwise.abort()
        self._held.clear()
        if self.lmcache_engine is not None:
            self.lmcache_engine.close()  # the process-wide tier keeps the chunks
        self.lmcache_engine = None
        self._registered = []
