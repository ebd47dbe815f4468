# SPDX-License-Identifier: Apache-2.0
"""Layerwise mode of the worker: one step's per-layer loads and saves, off the forward's path.

Batched loads on CUDA use the same machinery with one group of all layers: enqueued on the load
stream at ``start_load_kv``, the compute stream waits for them on the device at once, and the
host waits only at ``wait_for_save`` (after the forward is enqueued) to release the leases.

With ``use_layerwise``:

- **Loads prefetch.** ``start_load_kv`` enqueues every layer of every hit at once, in groups of
  1, 4, 16, ... layers (:func:`layer_groups`; one transfer per group): on CUDA on a load
  stream, recording an event per group, so later layers copy while earlier ones compute;
  ``wait_for_layer_load(i)`` only makes the compute stream wait for layer ``i``'s group (no host
  wait). A hit's host-to-device copy normally started at its lookup, on :attr:`copy_stream`, in
  the same groups (``VLLMPagedConnector.prefetch``); the load stream then only scatters, each group
  as soon as its copy is in. On the CPU the copies run in ``start_load_kv``.
- **Saves are queued.** ``save_kv_layer(i)`` records an event after layer ``i``'s compute (CUDA)
  and queues the copy of that layer on the :class:`~lmcache_vllm.worker.save_queue.SaveQueue`'s copy
  thread, returning at once. On CUDA the copy thread only *enqueues* it (on a store stream that
  waits for the event) and releases the layer's read fence as soon as its gather is enqueued,
  as for batched saves: the next step's ``bind_connector_metadata`` never waits on the host for
  a layer's bytes to reach the host. The step's end queues the commit, which sleeps until the
  last layer's copy is on the host, then checksums and publishes: chunks of a layerwise save
  become visible only then.
- **Saves never store what a failed load spoiled.** A save is cut to the chunks that end
  before the first token a failed load left unfilled, as far as the step knows when the
  forward saves its first layer (:class:`~lmcache_vllm.worker.failed_loads.FailedLoads`). A load's checksums
  are known only at the step's end, with its layers' copies already queued: the step's end
  waits for its loads first, then drops (and releases) instead of committing each save that
  a failed load spoiled.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from lmcache.devices import DeviceBackend, get_backend
from lmcache.gpu_connector import TransferSpec
from lmcache_vllm.connector_metadata import ReqMeta
from lmcache_vllm.transfer.transfer_plan import save_mask, slot_mapping
from lmcache_vllm.worker.failed_loads import FailedLoads
from lmcache_vllm.worker.save_queue import CommitJob, ReadFence, SaveQueue

if TYPE_CHECKING:
    from lmcache.cache_engine import HeldHit, LayerwiseRetrieve, LayerwiseStore, LMCacheEngine

__all__ = ["LayerwiseStep", "PendingSave", "layer_groups"]

logger = logging.getLogger(__name__)


def layer_groups(num_layers: int, growth: int = 4) -> list[range]:
    """Layers in the groups a layerwise load moves them: 1, 4, 16, ... layers (each group
    ``growth`` times the last), so the first layer is ready after one layer's copy and the rest
    come in a few large transfers.

    >>> [(g.start, g.stop) for g in layer_groups(32)]
    [(0, 1), (1, 5), (5, 21), (21, 32)]
    """
    groups, start, size = [], 0, 1
    while start < num_layers:
        stop = min(num_layers, start + size)
        groups.append(range(start, stop))
        size *= growth
        start = stop
    return groups


class PendingSave:
    """One request's layerwise store in this step.

    Args:
        req: The request.
        slots: The request's slot mapping (host, int64) over the tokens stored.
        begin: Starts the store given its transfer (``LMCacheEngine.store_layerwise`` with
            every other argument bound: plans and leases buffers); called by the first layer's
            copy job, on the save thread.
        on_done: Called once with the tokens stored, or ``None`` when the save failed.
    """

    def __init__(
        self,
        req: ReqMeta,
        slots: torch.Tensor,
        begin: Callable[..., LayerwiseStore],
        on_done: Callable[[int | None], None],
    ) -> None:
        self.req = req
        self.slots = slots
        self.begin = begin
        self.storer: LayerwiseStore | None = None
        self.on_done = on_done
        self.failed = False
        self.fence: ReadFence | None = None  # of the layer being copied (CUDA)


class LayerwiseStep:
    """The layerwise loads and saves of the current step.

    Args:
        load_lock: Held while a load is enqueued or finished (the worker's synchronous loads
            take it too).
        store_lock: Held while a store's copy is enqueued (the worker's batched saves take it
            too). A store and a load never wait for each other.
        saves: The worker's save queue (copies and commits).
        device: The KV caches' device (CUDA: streams and events; CPU: in order on the host).
        on_load_failed: Called with a request whose load failed (its blocks become load errors).
        on_chunks_rejected: Called with a request, its final load mask and the tokens lost,
            when chunks failed their checksum at the end of the load.
        failed: What failed loads spoiled (the step's saves store none of it).
    """

    def __init__(
        self,
        load_lock: threading.Lock,
        store_lock: threading.Lock,
        saves: SaveQueue,
        device: torch.device,
        on_load_failed: Callable[[ReqMeta], None],
        backend: DeviceBackend | None = None,
        on_chunks_rejected: Callable[[ReqMeta, torch.Tensor, int], None] | None = None,
        failed: FailedLoads | None = None,
    ) -> None:
        self._load_lock = load_lock
        self._store_lock = store_lock
        self._saves = saves
        self._backend = get_backend(device) if backend is None else backend
        self._cuda = self._backend.has_streams  # streams: asynchronous copies and events
        self._device = device
        self._on_load_failed = on_load_failed
        self._on_chunks_rejected = on_chunks_rejected
        # none given: a record of its own, which no load marks
        self._failed = FailedLoads(1, 1) if failed is None else failed
        self._loads: list[tuple[ReqMeta, LayerwiseRetrieve, HeldHit | None]] = []
        self._layer_ready: dict[int, Any] = {}  # layer -> CUDA event after its loads
        self._saving: list[PendingSave] = []
        self.saves_started = False
        self.load_stream: Any = None  # scatters into the engine's pages
        self.copy_stream: Any = None  # host -> device copies of hits ahead of their scatter
        self.store_stream: Any = None
        if self._cuda:
            self.load_stream = self._backend.new_stream(device)
            self.copy_stream = self._backend.new_stream(device)
            self.store_stream = self._backend.new_stream(device)

    # ------------------------------------------------------------------ loads

    def start_loads(
        self,
        loads: Sequence[tuple[ReqMeta, LayerwiseRetrieve, HeldHit | None]],
        num_layers: int,
        *,
        whole: bool = False,
    ) -> None:
        """Enqueue every layer of these loads now (see the module docstring); ``whole``: all
        layers in one transfer, and the compute stream waits for it at once (batched mode on
        CUDA: the host does not wait for the copy, the forward's kernels queue behind it)."""
        if not loads:
            return
        self._loads += loads
        if self._cuda:  # after everything queued so far (earlier steps may still read pages)
            self._backend.wait_stream(self.load_stream, self._backend.current_stream(self._device))
        groups = [range(num_layers)] if whole else layer_groups(num_layers)
        for group in groups:
            for item in list(self._loads):
                req, retriever, held = item
                try:
                    with self._load_lock, self._backend.use_stream(self.load_stream):
                        retriever.load_layers(group.stop)
                except Exception:
                    logger.exception("lmcache: layerwise load of %s failed", req.req_id)
                    self._loads.remove(item)
                    if held is not None:
                        held.release()
                    self._on_load_failed(req)
            if self._cuda:
                event = self._backend.event_after(self.load_stream)
                for layer in group:
                    self._layer_ready[layer] = event

        if whole and self._cuda:
            loaded: Any = self._layer_ready.get(0)
            self._layer_ready.clear()
            if loaded is not None:
                self._backend.wait_event(self._backend.current_stream(self._device), loaded)

    def wait_layer(self, layer: int) -> None:
        """Order the forward's use of ``layer`` after its loads (a device-side wait)."""
        event = self._layer_ready.pop(layer, None)
        if event is not None:
            self._backend.wait_event(self._backend.current_stream(self._device), event)

    # ------------------------------------------------------------------ saves

    def start_saves(self, saves: Sequence[PendingSave]) -> None:
        """Drive these stores per layer this step."""
        self.saves_started = True
        self._saving += saves

    def plan_saves(
        self,
        engine: LMCacheEngine,
        requests: Sequence[ReqMeta],
        chunk_size: int,
        block_size: int,
        on_done: Callable[[str, list[int]], Callable[[int | None], None]],
    ) -> None:
        """Drive the stores of ``requests`` that save this step, each cut to what the failed
        loads known so far spared; ``on_done(salt, tokens)`` gives each its ``on_done``."""
        saves = []
        for req in requests:
            kept = self._failed.allowed(req)
            if kept is None or kept.save is None:
                continue
            tokens = kept.token_ids[: kept.save.end]
            begin = partial(
                engine.store_layerwise,
                tokens,
                save_mask(len(tokens), kept.save.skip, chunk_size),
                salt=kept.salt,
                extra_keys=kept.extra_keys or None,
            )  # leases its buffers on the save thread, not in the forward
            slots = slot_mapping(kept.block_ids, block_size, len(tokens))
            saves.append(PendingSave(kept, slots, begin, on_done(kept.salt, tokens)))
        self.start_saves(saves)

    def save_layer(self, layer: int) -> None:
        """Queue the copy of ``layer`` of every pending save (returns at once)."""
        if not self._saving:
            return
        ready = None
        if self._cuda:
            ready = self._backend.event_after(self._backend.current_stream(self._device))
        for save in self._saving:
            fence = ReadFence()
            self._saves.submit(save.req.req_id, self._copy_job(save, layer, ready, fence), fence)

    def _transfer(self, save: PendingSave) -> TransferSpec:
        """How ``save`` copies: on CUDA deferred on the store stream (the copy thread does not
        wait for the bytes), each layer's fence released once its gather is enqueued."""
        if not self._cuda:
            return TransferSpec(save.slots)
        stream = self.store_stream
        backend = self._backend

        def _read() -> None:
            fence = save.fence
            if fence is not None:
                fence.release(backend.event_after(stream))

        return TransferSpec(save.slots, stream=stream, deferred=True, on_engine_read=_read)

    def _copy_job(
        self, save: PendingSave, layer: int, ready: Any, fence: ReadFence
    ) -> Callable[[], None]:
        def _copy() -> None:
            if save.failed:
                return
            try:
                if save.storer is None:
                    save.storer = save.begin(transfer=self._transfer(save))
                storer = save.storer
                with self._store_lock:
                    if ready is None:
                        storer.store_layer(layer)
                    else:
                        self._backend.wait_event(self.store_stream, ready)
                        save.fence = fence
                        with self._backend.use_stream(self.store_stream):
                            storer.store_layer(layer)
                            done = self._backend.event_after(self.store_stream)
                        fence.release(done)  # no-op when the gather released it
            except BaseException:
                save.failed = True
                self._drop(save)
                save.on_done(None)
                raise

        return _copy

    def _drop(self, save: PendingSave) -> None:
        """Release ``save``'s buffers once no queued copy writes them any more."""
        if save.storer is not None:
            if self._cuda:
                self._backend.stream_synchronize(self.store_stream)
            save.storer.abort()

    def _drop_job(self, save: PendingSave) -> Callable[[], None]:
        """A failed load spoiled ``save``'s KV: release its buffers (after the copies queued
        before this job) and publish nothing."""

        def _drop_spoiled() -> None:
            if save.failed:
                return  # a copy failed: dropped already
            save.failed = True
            self._drop(save)
            save.on_done(None)

        return _drop_spoiled

    def _commit_job(self, save: PendingSave) -> Callable[[], CommitJob | None]:
        def _queue_commit() -> CommitJob | None:
            storer = save.storer
            if save.failed or storer is None:
                if not save.failed:
                    save.on_done(None)  # no layer was ever saved (the forward skipped us)
                return None
            copied: Any = None
            if self._cuda:  # after the last layer's copy to the host; the commit sleeps on it
                copied = self._backend.event_after(self.store_stream, blocking=True)

            def _commit() -> None:
                try:
                    if copied is not None:
                        try:
                            self._backend.event_synchronize(copied)
                        except BaseException:
                            storer.abort()
                            raise
                    stored = storer.finish()
                except BaseException:
                    save.on_done(None)
                    raise
                save.on_done(stored)

            return _commit

        return _queue_commit

    # ------------------------------------------------------------------ step end

    def finish(self, exchange: Callable[[], None] | None = None) -> None:
        """End of step: wait for the loads, release their leases, then queue the saves'
        commits. A save whose KV a failed load spoiled is dropped instead: the loads' outcome
        must be known before any commit is queued. ``exchange`` runs in between: it learns the
        other tensor-parallel ranks' failures (:mod:`lmcache_vllm.worker.rank_failures`)."""
        self._finish_loads()
        if exchange is not None:
            exchange()
        for save in self._saving:
            spoiled = self._failed.spoils(save.req, len(save.slots))
            job = self._drop_job(save) if spoiled else self._commit_job(save)
            self._saves.submit(save.req.req_id, job)
        self._saving = []
        self.saves_started = False

    def _finish_loads(self) -> None:
        """Wait for the step's loads, note the chunks that failed, release their leases."""
        if self._loads and self._cuda:
            self._backend.stream_synchronize(
                self.load_stream
            )  # before the leases go: no copy reads a freed buffer
        for req, retriever, held in self._loads:
            try:
                with self._load_lock:
                    promised = retriever.num_hit_tokens
                    loaded = retriever.finish()
                lost = promised - int(loaded.sum())
                if lost and self._on_chunks_rejected is not None:
                    self._on_chunks_rejected(req, loaded, lost)
            except Exception as exc:  # layers missing: the forward did not call us per layer
                logger.warning("lmcache: layerwise load of %s incomplete (%s)", req.req_id, exc)
                self._on_load_failed(req)
            finally:
                if held is not None:
                    held.release()
        self._loads = []
        self._layer_ready.clear()

    def abort(self) -> None:
        """Drop every pending load and save (shutdown)."""
        for _, retriever, held in self._loads:
            retriever.abort()
            if held is not None:
                held.release()
        for save in self._saving:
            save.failed = True
            self._drop(save)
            save.on_done(None)
        self._loads, self._saving = [], []
        self._layer_ready.clear()
