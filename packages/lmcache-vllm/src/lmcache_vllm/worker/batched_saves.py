# SPDX-License-Identifier: Apache-2.0
"""Batched saves of the worker: a step's saves planned during its forward, copied after it.

Everything here runs in the worker process.
vLLM's forward thread notes a step's saves at bind and queues their plan and their copy.
The save queue's copy thread plans them and copies the KV out of vLLM's pages.
Its commit thread publishes the chunks once the bytes are on the host.
No save stores a chunk that a failed load of the step spoiled
(:class:`~lmcache_vllm.worker.failed_loads.FailedLoads`). A save is cut before its plan when the
failure is known by then (a synchronous load). When it is known only at the step's end (a load
enqueued on CUDA), the save is copied but its commit is dropped.
Layerwise saves go through :mod:`lmcache_vllm.worker.layerwise_step` instead.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from lmcache.cache_engine import LMCacheEngine
from lmcache.devices import DeviceBackend, get_backend
from lmcache.gpu_connector import TransferSpec
from lmcache_vllm.connector_metadata import LMCacheConnectorMetadata, ReqMeta
from lmcache_vllm.transfer.transfer_plan import save_mask, slot_mapping
from lmcache_vllm.worker.counters import WorkerCounters
from lmcache_vllm.worker.failed_loads import FailedLoads
from lmcache_vllm.worker.save_queue import (
    CommitJob,
    CopyJob,
    ReadFence,
    SaveQueue,
    UnpublishedSaves,
)

if TYPE_CHECKING:
    from lmcache.cache_engine import PlannedStore, StoreBatch

__all__ = ["BatchedSaves"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class _PlannedSave:
    """One request's batched save this step; ``job``: its :class:`UnpublishedSaves` id;
    ``spoiled``: a failed load of the step spoiled its KV (copied, never committed)."""

    req: ReqMeta
    tokens: list[int]
    job: int
    planned: PlannedStore | None = None
    spoiled: bool = False


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


class BatchedSaves:
    """The batched saves of one worker (see the module docstring).

    Args:
        saves: The worker's save queue.
        unpublished: Saves a lookup of the same prompt waits for.
        store_lock: Held while a copy is enqueued (loads have their own).
        chunk_size: lmcache's chunk size in tokens.
        block_size: vLLM's block size in tokens.
        counters: Where finished saves are counted.
        failed: What the step's failed loads spoiled (saves store none of it).
    """

    def __init__(
        self,
        saves: SaveQueue,
        unpublished: UnpublishedSaves,
        store_lock: threading.Lock,
        chunk_size: int,
        block_size: int,
        counters: WorkerCounters,
        failed: FailedLoads | None = None,
    ) -> None:
        self._saves = saves
        # none given: a record of its own, which no load marks
        self._failed = FailedLoads(block_size, chunk_size) if failed is None else failed
        self._unpublished = unpublished
        self._store_lock = store_lock
        self.chunk_size = chunk_size
        self.block_size = block_size
        self._counters = counters
        self._engine: LMCacheEngine | None = None
        self._backend: DeviceBackend = get_backend("cpu")
        self._device = torch.device("cpu")
        self._stream: Any = None  # the worker's one store stream (CUDA caches)
        self._planned: _StepSaves | None = None  # this step's saves, noted at bind

    def attach(
        self, engine: LMCacheEngine, backend: DeviceBackend, device: torch.device, stream: Any
    ) -> None:
        """Save into ``engine`` from caches on ``device``; ``stream``: the store stream, if any."""
        self._engine = engine
        self._backend = backend
        self._device = device
        self._stream = stream if backend.has_streams else None

    def _mask(self, num_tokens: int, skip: int) -> torch.Tensor | None:
        return save_mask(num_tokens, skip, self.chunk_size)

    def note(self, meta: LMCacheConnectorMetadata) -> None:
        """Note this step's saves (a lookup of the same prompt waits for them from now on).

        Their host side (chunk keys, host buffers, the connector's plan of one copy for all of
        them) is planned on the copy thread while the step computes their KV
        (:meth:`queue_plan`).
        So after the step only one copy is left to enqueue.
        """
        if self._engine is None:
            return
        saves = []
        for req in meta.requests:
            if req.save is not None:
                tokens = req.token_ids[: req.save.end]
                saves.append(_PlannedSave(req, tokens, self._unpublished.add(req.salt, tokens)))
        if saves:
            self._planned = _StepSaves(saves)

    def save_finished(self, reqs: list[ReqMeta]) -> None:
        """Queue one batched save of finished requests' chunks.

        Their KV was written by the steps before this one.
        The caller fences, so the pages are read before this step writes any.
        """
        engine = self._engine
        if engine is None:
            return
        saves = []
        for req in reqs:
            kept = self._failed.allowed(req)  # what a failed load of their last step spared
            if kept is not None and kept.save is not None:
                tokens = kept.token_ids[: kept.save.end]
                saves.append(_PlannedSave(kept, tokens, self._unpublished.add(kept.salt, tokens)))
        if not saves:
            return
        step = _StepSaves(saves, queued=True)
        self._saves.submit(step.label, partial(self._plan_job, engine, step))
        # CUDA: after every forward enqueued so far (the one that wrote this KV)
        ready = self._forward_event() if self._stream is not None else None
        fence = ReadFence()
        self._saves.submit(step.label, self._save_job(step, ready, fence), fence)

    def queue_plan(self) -> None:
        """Queue the planning of this step's saves on the copy thread, once.

        The worker calls this at the forward's last layer.
        vLLM's thread has then enqueued nearly all of the forward, so the planning's Python no
        longer competes with it for the GIL while the GPU could starve.
        Otherwise it runs at ``wait_for_save``, for a forward whose layers do not call
        ``save_kv_layer`` (e.g. inside a CUDA graph).
        """
        step, engine = self._planned, self._engine
        if step is None or step.queued or engine is None:
            return
        step.queued = True
        self._cut(step)
        self._saves.submit(step.label, partial(self._plan_job, engine, step))

    def _cut(self, step: _StepSaves) -> None:
        """Cut each save of ``step`` to what the failed loads known so far spared."""
        kept = []
        for save in step.saves:
            allowed = self._failed.allowed(save.req)
            if allowed is None or allowed.save is None:
                self._unpublished.done(save.job)
                continue
            if allowed is not save.req:
                save.req, save.tokens = allowed, save.tokens[: allowed.save.end]
            kept.append(save)
        step.saves = kept

    def _plan_job(self, engine: LMCacheEngine, step: _StepSaves) -> None:
        """Copy thread: plan every save of ``step`` (one failing drops only that one), then
        their batch (:meth:`LMCacheEngine.batch_stores`: one connector call for all)."""
        stream = self._stream
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
                        TransferSpec(
                            slot_mapping(req.block_ids, self.block_size, len(save.tokens))
                        ),
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

    def drop_planned(self) -> None:
        """Release the buffers of saves planned at the last bind whose ``wait_for_save`` never
        came (on the copy thread, after their plan job)."""
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

    def close(self) -> None:
        """Drop saves planned for a step that never ended (the save queue is closed)."""
        if self._planned is not None:
            self._drop_job(self._planned)
            self._planned = None

    def wait_for_save(self) -> None:
        """Queue the copy of this step's saves (planned during the forward), and return at once."""
        self.queue_plan()
        step, self._planned = self._planned, None
        cuda = self._stream is not None
        if step is None:
            if cuda and self._saves.gate.waiting:  # commits wait for a forward in flight
                self._saves.gate.forward_enqueued(self._forward_event())
            return
        for save in step.saves:  # a load enqueued on the device may have failed since the plan
            save.spoiled = self._failed.spoils(save.req, len(save.tokens))
        ready = self._forward_event() if cuda else None
        if ready is not None:
            self._saves.gate.forward_enqueued(ready)
        fence = ReadFence()
        self._saves.submit(step.label, self._save_job(step, ready, fence), fence)

    def _forward_event(self) -> Any:
        """A CUDA event on vLLM's stream after the forward enqueued so far."""
        backend = self._backend
        return backend.event_after(backend.current_stream(self._device))

    def _save_job(self, step: _StepSaves, ready: Any, fence: ReadFence) -> CopyJob:
        """The copy job of a step's planned saves (on CUDA it releases ``fence`` once vLLM's
        pages are read and returns before the bytes reach the host); it returns the commit
        job, which publishes each request's chunks."""

        def _copy() -> CommitJob | None:
            batch, spec, live = step.batch, step.spec, step.live
            if batch is None or spec is None:
                return None  # the plan failed (logged): nothing to copy
            if all(save.spoiled for save in live):  # nothing to commit: nothing to copy
                batch.abort()
                for save in live:
                    self._unpublished.done(save.job)
                return None
            started = time.perf_counter()
            copied: Any = None  # CUDA: the event after the copy to the host
            try:
                with self._store_lock:
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
                    if save.spoiled:  # copied with the batch: its buffers go back unpublished
                        st.abort()
                        self._unpublished.done(save.job)
                        continue
                    try:
                        stored = st.commit()
                    except Exception:
                        logger.exception("lmcache: save of request %s failed", save.req.req_id)
                        continue
                    finally:
                        self._unpublished.done(save.job)
                    self._counters.count_save(stored, time.perf_counter() - started)

            return _commit

        return _copy
