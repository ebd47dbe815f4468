# SPDX-License-Identifier: Apache-2.0
"""The fused all-layer transfer strategy of
:class:`~lmcache_vllm.transfer.paged_connector.VLLMPagedConnector`.

It serves ``kv_concat`` and ``mla`` caches whose layers are views of one buffer with a uniform
step between layers, which is how vLLM allocates them.
All layers are gathered and scattered through one strided ``[layers, blocks, block_size, ...]``
view, with one advanced-indexing op per run of equal-sized chunks.
Every transfer moves all chunks of a request at once, through one *chunk-major* staging buffer
(on the device when ``config.gpu_staging_buffer``).
Chunk ``c``'s ``[num_layers, tokens, kv_width]`` block is contiguous there.
So each chunk, or each run of chunks whose host buffers lie back to back in one pool slab, moves
in one copy-engine DMA.
The same part of several chunks at a constant step (a layer group of each chunk) moves in one
strided 2D copy (``cudaMemcpy2DAsync``).
The one-row copies of a piece go in one batched call (``cudaMemcpyBatchAsync`` where the runtime
has it).
Every copy goes through the connector's device backend (:mod:`lmcache.devices`).
Slot indices are built once per call.
They are built on the host when the slot mapping is on the host (the adapter's case: no device
sync at all), and reach the device through a persistent pinned buffer.

The connector builds :class:`FusedTransfer` from the
:class:`~lmcache_vllm.transfer.paged_cache.PagedKVCache` it checked and its device backend
(:meth:`FusedTransfer.for_cache`).
It reads nothing of the connector.
Its parts, one module each:

- :mod:`~lmcache_vllm.transfer.fused.plan`: the staging plan.
- :mod:`~lmcache_vllm.transfer.fused.slot_indices`: the slot indices.
- :mod:`~lmcache_vllm.transfer.fused.views`: the views, gathers, scatters and host copies.
- :mod:`~lmcache_vllm.transfer.fused.store`: the store side.
- this module: the load side (loads, prefetches, checks of hits) and construction.

This module never imports vLLM.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from lmcache import gpu_ops
from lmcache.gpu_connector.checksums import LoadChecks
from lmcache.gpu_connector.interface import ChunkTransfer, TransferSpec
from lmcache_vllm.transfer.fused.plan import Prefetched, StagingPlan, add_run, piece_spans
from lmcache_vllm.transfer.fused.store import FusedStore
from lmcache_vllm.transfer.fused.verified_scatter import LoadIndex
from lmcache_vllm.transfer.paged_cache import PagedKVCache

if TYPE_CHECKING:
    from lmcache.devices import DeviceBackend

__all__ = ["FusedTransfer", "Prefetched"]

logger = logging.getLogger(__name__)


class FusedTransfer(FusedStore):
    """The fused all-layer path (see the module docstring).

    Args:
        cache: A ``kv_concat`` or ``mla`` cache.
        backend: The cache device's backend: every stream, event, pinned buffer and host copy
            goes through it.
        checksums: Stores sum their chunks on the device (loads verify whatever sums the
            chunks carry).

    Use :meth:`for_cache`, which returns ``None`` when the layers allow no fused views.
    """

    def __init__(self, cache: PagedKVCache, backend: DeviceBackend, checksums: bool = True) -> None:
        super().__init__(cache, backend, checksums)
        if self._sums is not None:
            self.warm_up()

    def warm_up(self) -> None:
        """Run one store and one verified load of a single page, so that the first request
        finds streams, pinned index buffers, library symbols and kernels ready.

        The store reads page 0. The load writes the last token of page 0 back with the bytes
        just read from it (the others are skipped), so no page changes.
        """
        n = self.block_size
        nbytes = self.num_layers * n * self.kv_width * self._caches[0].element_size()
        host = self.backend.pinned_empty(nbytes).view(self.dtype)
        chunk = ChunkTransfer(0, n, host.view(self.num_layers, n, self.kv_width))
        slots = torch.arange(n, dtype=torch.int64)
        try:
            sums = self.from_cache(range(self.num_layers), [chunk], TransferSpec(slots))
            value = sums.values()[0] if sums is not None else None
            same = TransferSpec(slots, skip_tokens=n - 1)
            stored = dataclasses.replace(chunk, checksum=value)
            self.to_cache(range(self.num_layers), [stored], same)
            self._sync(same)
        except Exception as exc:  # an optimisation: a first request then pays for it instead
            logger.warning("lmcache: warm-up transfer failed (%s); continuing without it", exc)

    @property
    def verifies_checksums(self) -> bool:
        """Whether stores sum their chunks on the device and loads verify them there (a
        device with streams)."""
        return self._sums is not None

    @classmethod
    def for_cache(
        cls, cache: PagedKVCache, backend: DeviceBackend, checksums: bool = True
    ) -> FusedTransfer | None:
        """The fused path of ``cache``, or ``None`` when its layers allow neither one view nor
        one view per layer (layers that differ in strides). ``checksums``: stores sum their
        chunks on the device (the configuration's ``checksum``)."""
        fused = cls(cache, backend, checksums)
        return fused if fused._fused_any else None

    def prefetch(
        self, chunks: Sequence[ChunkTransfer], stream: Any, groups: Sequence[range] = ()
    ) -> Prefetched | None:
        """Copy whole chunks (all layers) to a new device staging buffer now, on ``stream``.

        For a load that comes later (pass the result as ``TransferSpec.staged``): the copy
        overlaps whatever the engine does meanwhile, and the load only scatters. With
        ``groups`` (consecutive layer ranges from layer 0, e.g. a layerwise load's groups) the
        copy goes group by group, recording an event after each, so a load of the first layers
        waits only for their copy. ``None`` unless this is a CUDA connector on the fused path.
        The chunks' host buffers must not change until the returned event completes (leased
        chunks never do).
        """
        backend = self.backend
        if not backend.has_streams or not self._fused_any or not chunks:
            return None
        full = range(self.num_layers)
        plan = self._kernel_plan(full, chunks, 0)  # pieces of whole chunks, each with an event
        grouped = (  # groups that tile every layer in order; anything else: one copy
            len(groups) > 1
            and groups[0].start == 0
            and groups[-1].stop == full.stop
            and all(g.step == 1 and g.start < g.stop for g in groups)
            and all(x.stop == y.start for x, y in itertools.pairwise(groups))
        )
        layer_events: list[tuple[int, Any]] = []
        chunk_events: list[tuple[int, Any]] = []
        with backend.use_stream(stream):
            staging = torch.empty(
                plan.total * plan.row_bytes, dtype=torch.uint8, device=self.device
            )
            if grouped:  # layer-major: group g of every chunk, then group g + 1
                runs = StagingPlan(plan.row_bytes, plan.layer_bytes, [])
                for piece, group in enumerate(groups):
                    pos = 0
                    for c in chunks:
                        n = c.num_tokens
                        add_run(
                            runs,
                            pos * plan.row_bytes + group.start * n * plan.layer_bytes,
                            len(group) * n * plan.layer_bytes,
                            c.buffer[group.start : group.stop],
                            piece,
                        )
                        pos += n
                    self._copy_runs(runs, staging, to_host=False, piece=piece)
                    layer_events.append((group.stop, backend.event_after(stream)))
                event = layer_events[-1][1]
            else:  # a lookup's check of piece i runs while piece i + 1 is copied
                for piece, (_, stop, _, _) in enumerate(piece_spans(plan)):
                    self._copy_runs(plan, staging, to_host=False, piece=piece)
                    chunk_events.append((stop, backend.event_after(stream)))
                event = chunk_events[-1][1]
        offsets, pos = [], 0
        for start, end, _ in plan.staged:
            offsets.append(pos * plan.row_bytes)
            pos += end - start
        return Prefetched(
            staging, plan.staged, offsets, event, stream, layer_events, chunk_events=chunk_events
        )

    def _fused_to_staged(
        self, layers: range, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> bool | LoadChecks:
        """Scatter ``layers`` from ``transfer.staged`` when it covers the chunks (waiting only
        for the copy of those layers); ``False``: not used.

        Chunks that the lookup verified in this very copy (:meth:`verify_chunks`) are scattered
        without a second check. Other chunks with checksums are verified as they are scattered
        (:meth:`_verify`).
        """
        pre = transfer.staged
        backend = self.backend
        if not isinstance(pre, Prefetched) or not backend.has_streams:
            return False
        full = range(self.num_layers)
        key = [(c.start, c.end, c.buffer.data_ptr()) for c in chunks]
        cached = pre.scatter_plan
        summed = self._verifying(chunks)
        checked = summed and pre.verified_all(chunks)  # at lookup, in this device copy
        verify = summed and not checked
        kernel = summed or self._kernel_load(transfer)
        with self._stream_ctx(transfer):
            if cached is not None and cached[0]() is transfer and cached[1] == key:
                plan, base, idx = cached[2:]  # checked when first built
            else:
                plan = self._plan(full, chunks, transfer.skip_tokens, piece_bytes=0)
                found = pre.base_for(plan)
                if found is None:
                    return False
                base = found
                if kernel:
                    assert self._sums is not None
                    idx = self._sums.load_index(plan, chunks, transfer)
                else:
                    idx, check = self._fused_indices(plan, transfer)
                    check()
                # a weak reference: ``transfer.staged`` is ``pre``, and a cycle would keep the
                # device copy (and the prefetch budget it holds) until a full collection
                pre.scatter_plan = (weakref.ref(transfer), key, plan, base, idx)
            main = backend.current_stream(self.device)
            backend.wait_event(main, pre.event_for(layers.stop))
            if main != pre.stream:
                backend.record_stream(pre.staging, main)
            if isinstance(idx, LoadIndex):
                assert self._sums is not None
                staged = pre.staging[base : base + plan.total * plan.row_bytes]
                if verify:
                    return self._verify(idx, staged, layers, staging_full=True)
                self._sums.scatter(idx, staged, layers, staging_full=True)
                return self._sums.checked_before(idx) if checked else True
            self._scatter(plan, pre.staging[base:], full, idx, -1, only=layers)
        return True

    def verify_chunks(
        self, chunks: Sequence[ChunkTransfer], stream: Any, prefetched: Prefetched | None
    ) -> list[bool] | None:
        """Check whole chunks against their ``checksum`` on the device now, on ``stream``, and
        wait (``None``: this path computes no checksums).

        A ``prefetched`` copy that holds the chunks from its first one on is checked in place,
        after its copy. It keeps the verdicts: its load then scatters the chunks that matched
        without checking them again.
        """
        if self._sums is None or not chunks:
            return None
        keys = [(c.start, c.end, c.buffer.data_ptr()) for c in chunks]
        in_place = prefetched is not None and prefetched.chunks[: len(chunks)] == keys
        staged = None
        if prefetched is not None and in_place:
            self.backend.record_stream(prefetched.staging, stream)
            ready = prefetched.chunk_events or [(len(prefetched.chunks), prefetched.event)]
            staged = (prefetched.staging, prefetched.offsets, ready)
        ok = self._sums.verify_chunks(chunks, stream, staged)
        if prefetched is not None and in_place:
            prefetched.verified.update(
                (k, c.checksum)
                for k, c, good in zip(keys, chunks, ok, strict=True)
                if good and c.checksum is not None
            )
        return ok

    def _verifying(self, chunks: Sequence[ChunkTransfer]) -> bool:
        """Whether a load of ``chunks`` goes through the verified scatter (checksums on the
        device, and at least one chunk has a stored sum)."""
        return self._sums is not None and any(c.checksum is not None for c in chunks)

    kernel_scatter: bool = True
    """Load unverified chunks through the ``scatter_kv`` kernel too, where it runs as one launch
    (:func:`lmcache.gpu_ops.one_launch_ops`): one upload and one launch per call."""

    def _kernel_load(self, transfer: TransferSpec) -> bool:
        """Whether an unverified load goes through the ``scatter_kv`` kernel: it is on and runs
        as one launch here, and the slot mapping is on the host (checked there, no sync)."""
        return (
            self._sums is not None
            and self.kernel_scatter
            and transfer.slot_mapping.device.type == "cpu"
            and gpu_ops.one_launch_ops(self.device)
        )

    def _verify(
        self, index: LoadIndex, staging: torch.Tensor, layers: range, *, staging_full: bool
    ) -> LoadChecks:
        """The verified scatter of ``layers`` (all layers: verdicts before the scatter; some:
        the sums of the bytes moved, compared by the engine at the end)."""
        assert self._sums is not None
        if len(layers) == self.num_layers:
            return self._sums.verified_scatter(index, staging)
        return self._sums.summed_scatter(index, staging, layers, staging_full=staging_full)

    def to_cache(
        self, layers: range, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> bool | LoadChecks:
        """Copy ``layers`` of the chunks into the cache; ``False`` when nothing moved. Chunks
        with checksums go through the verified scatter, whose checks are returned."""
        if transfer.staged is not None:
            from_staged = self._fused_to_staged(layers, chunks, transfer)
            if from_staged is not False:
                return from_staged
        verify = self._verifying(chunks)
        kernel = verify or self._kernel_load(transfer)
        whole = len(layers) == self.num_layers
        if kernel and whole:  # pieces of whole chunks: each is checked once all of it is in
            plan = self._kernel_plan(layers, chunks, transfer.skip_tokens)
        else:  # a layer range is summed, not checked, in one piece
            plan = self._plan(layers, chunks, transfer.skip_tokens, 0 if kernel else -1)
        if plan.total == 0:
            return False
        with self._stream_ctx(transfer):
            nbytes = plan.total * plan.row_bytes
            try:
                staging = self._new_staging(nbytes)
            except torch.OutOfMemoryError:
                if len(layers) == 1:
                    raise
                if not self._staging_oom_logged:
                    self._staging_oom_logged = True
                    logger.warning(
                        "lmcache: no device memory for a %d MiB load staging buffer (it lies "
                        "outside vLLM's profiled memory; lower gpu_memory_utilization to leave "
                        "room); loading such hits one layer at a time",
                        nbytes >> 20,
                    )
                moved = False
                for layer in layers:  # a 1/len(layers) staging buffer at a time
                    moved = bool(self.to_cache(range(layer, layer + 1), chunks, transfer)) or moved
                return moved  # per-layer checks are dropped: the engine verifies on the host
            if kernel:
                assert self._sums is not None
                index = self._sums.load_index(plan, chunks, transfer)
                side = self._copy_stream(plan, to_host=False)
                if side is None:
                    self._copy_runs(plan, staging, to_host=False)
                    if verify:
                        return self._verify(index, staging, layers, staging_full=False)
                    self._sums.scatter(index, staging, layers, staging_full=False)
                    return True
                # check and scatter piece i while piece i + 1 comes from the host
                self.backend.wait_stream(side, self.backend.current_stream(self.device))
                ready = []
                with self.backend.use_stream(side):
                    for piece in range(plan.pieces):
                        self._copy_runs(plan, staging, to_host=False, piece=piece)
                        ready.append(self.backend.event_after(side))
                spans = piece_spans(plan)
                if verify:
                    return self._sums.verified_scatter_pieces(index, staging, spans, ready)
                self._sums.scatter_pieces(index, staging, spans, ready)
                return True
            idx, check = self._fused_indices(plan, transfer)
            copy = self._copy_stream(plan, to_host=False)
            if copy is None:
                self._copy_runs(plan, staging, to_host=False)
                check()
                self._scatter(plan, staging, layers, idx, -1)
            else:  # scatter piece i while piece i + 1 comes from the host
                backend = self.backend
                main = backend.current_stream(self.device)
                backend.wait_stream(copy, main)  # staging's memory may have been in use on main
                done = []
                with backend.use_stream(copy):
                    for piece in range(plan.pieces):
                        self._copy_runs(plan, staging, to_host=False, piece=piece)
                        done.append(backend.event_after(copy))
                check()
                for piece in range(plan.pieces):
                    backend.wait_event(main, done[piece])
                    self._scatter(plan, staging, layers, idx, piece)
        return True
