# SPDX-License-Identifier: Apache-2.0
"""Loads of the fused all-layer path: KV from the chunks' host buffers into vLLM's pages.

A hit runs these steps, in this order:

1. **Copy ahead** (:meth:`FusedLoad.prefetch`, at lookup, on a lookup thread). Whole chunks
   go to a device staging buffer in pieces of whole chunks, with an event after each piece.
2. **Verify ahead** (:meth:`FusedLoad.verify_chunks`, right after). Each piece is summed on the
   device once its copy is in, against the sums stored with its chunks. A bad chunk ends the
   hit before vLLM is promised its tokens. The verdicts stay with the device copy.
3. **Scatter** (:meth:`FusedLoad.load`, when vLLM starts the load). From a device copy made in
   step 1, one ``scatter_kv`` launch writes the chunks step 2 verified in those very bytes, with
   no second check; chunks it did not verify are verified in the scatter itself.

A load with no device copy (step 1 skipped: a layerwise load, no room, a CPU engine) copies the
chunks to staging in pieces. Each piece is summed and compared, and only its matching chunks
are scattered, once the piece's copy is in: the check runs right beside the copy it guards.
A chunk that did not match keeps its slots at ``-1``, so none of its bytes reach the pages.

Without the one-launch kernels the scatter goes through the strided views
(:class:`~lmcache_vllm.transfer.fused.views.FusedViews`) and the engine verifies on the host.
This module never imports vLLM.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from lmcache.gpu_connector.checksums import LoadChecks
from lmcache.gpu_connector.interface import ChunkTransfer, TransferSpec
from lmcache_vllm.transfer.fused.kernels import ChunkKernels, KernelIndex
from lmcache_vllm.transfer.fused.plan import Prefetched, StagingPlan, add_run, piece_spans
from lmcache_vllm.transfer.fused.views import FusedViews

if TYPE_CHECKING:
    from lmcache.devices import DeviceBackend

__all__ = ["FusedLoad"]

logger = logging.getLogger(__name__)


class FusedLoad:
    """The loads of one cache (see the module docstring).

    Args:
        views: The cache's views, plans and host copies.
        kernels: The one-launch kernels (a device with streams), else ``None``.
    """

    kernel_scatter: bool = True
    """Load unverified chunks through the ``scatter_kv`` kernel too, where it runs as one launch
    (:func:`lmcache.gpu_ops.one_launch_ops`): one upload and one launch per call."""

    _staging_oom_logged = False

    def __init__(self, views: FusedViews, kernels: ChunkKernels | None) -> None:
        self.views = views
        self.kernels = kernels
        self.device = views.device

    @property
    def backend(self) -> DeviceBackend:
        """The cache device's backend (the views')."""
        return self.views.backend

    # -- 1. copy ahead --------------------------------------------------------------------------

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
        views, backend = self.views, self.backend
        if not backend.has_streams or not views.usable or not chunks:
            return None
        full = range(views.num_layers)
        plan = views.kernel_plan(full, chunks, 0)  # pieces of whole chunks, each with an event
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
            staging = views.new_staging(plan.total * plan.row_bytes)
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
                    views.copy_runs(runs, staging, to_host=False, piece=piece)
                    layer_events.append((group.stop, backend.event_after(stream)))
                event = layer_events[-1][1]
            else:  # step 2 checks piece i while piece i + 1 is copied
                for piece, (_, stop, _, _) in enumerate(piece_spans(plan)):
                    views.copy_runs(plan, staging, to_host=False, piece=piece)
                    chunk_events.append((stop, backend.event_after(stream)))
                event = chunk_events[-1][1]
        offsets, pos = [], 0
        for start, end, _ in plan.staged:
            offsets.append(pos * plan.row_bytes)
            pos += end - start
        return Prefetched(
            staging, plan.staged, offsets, event, stream, layer_events, chunk_events=chunk_events
        )

    # -- 2. verify ahead ------------------------------------------------------------------------

    def verify_chunks(
        self, chunks: Sequence[ChunkTransfer], stream: Any, prefetched: Prefetched | None
    ) -> list[bool] | None:
        """Check whole chunks against their ``checksum`` on the device now, on ``stream``, and
        wait (``None``: this path computes no checksums).

        A ``prefetched`` copy that holds the chunks from its first one on is checked in place,
        piece by piece as its copy lands. It keeps the verdicts: its load then scatters the
        chunks that matched without checking them again.
        """
        if self.kernels is None or not chunks:
            return None
        keys = [(c.start, c.end, c.buffer.data_ptr()) for c in chunks]
        in_place = prefetched is not None and prefetched.chunks[: len(chunks)] == keys
        staged = None
        if prefetched is not None and in_place:
            self.backend.record_stream(prefetched.staging, stream)
            ready = prefetched.chunk_events or [(len(prefetched.chunks), prefetched.event)]
            staged = (prefetched.staging, prefetched.offsets, ready)
        ok = self.kernels.verify_chunks(chunks, stream, staged)
        if prefetched is not None and in_place:
            prefetched.verified.update(
                (k, c.checksum)
                for k, c, good in zip(keys, chunks, ok, strict=True)
                if good and c.checksum is not None
            )
        return ok

    # -- 3. scatter -----------------------------------------------------------------------------

    def load(
        self, layers: range, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> bool | LoadChecks:
        """Copy ``layers`` of the chunks into the cache; ``False`` when nothing moved. Chunks
        with checksums are verified on the device, and the checks are returned."""
        if transfer.staged is not None:
            from_copy = self._from_prefetched(layers, chunks, transfer)
            if from_copy is not False:
                return from_copy
        if self._verifying(chunks) or self._by_kernel(transfer):
            return self._kernel_load(layers, chunks, transfer)
        return self._strided_load(layers, chunks, transfer)

    def _verifying(self, chunks: Sequence[ChunkTransfer]) -> bool:
        """Whether a load of ``chunks`` is verified on the device (the kernels run here, and
        at least one chunk has a stored sum)."""
        return self.kernels is not None and any(c.checksum is not None for c in chunks)

    def _by_kernel(self, transfer: TransferSpec) -> bool:
        """Whether an unverified load goes through the ``scatter_kv`` kernel: it is on and runs
        as one launch here, and the slot mapping is on the host (checked there, no sync)."""
        return (
            self.kernel_scatter and self.kernels is not None and self.kernels.one_launch(transfer)
        )

    def _from_prefetched(
        self, layers: range, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> bool | LoadChecks:
        """Scatter ``layers`` from the device copy ``transfer.staged`` when it covers the
        chunks, waiting only for the copy of those layers; ``False``: not used.

        Chunks verified in this very copy (step 2) are scattered unchecked; other chunks with
        checksums are verified as they are scattered.
        """
        pre = transfer.staged
        views, backend = self.views, self.backend
        if not isinstance(pre, Prefetched) or not backend.has_streams:
            return False
        full = range(views.num_layers)
        key = [(c.start, c.end, c.buffer.data_ptr()) for c in chunks]
        cached = pre.scatter_plan
        summed = self._verifying(chunks)
        checked = summed and pre.verified_all(chunks)  # step 2, in this device copy
        verify = summed and not checked
        kernel = summed or self._by_kernel(transfer)
        with views.stream_ctx(transfer):
            if cached is not None and cached[0]() is transfer and cached[1] == key:
                plan, base, idx = cached[2:]  # checked when first built
            else:
                plan = views.staging_plan(full, chunks, transfer.skip_tokens, piece_bytes=0)
                found = pre.base_for(plan)
                if found is None:
                    return False
                base = found
                if kernel:
                    assert self.kernels is not None
                    idx = self.kernels.load_index(plan, chunks, transfer)
                else:
                    idx, check = views.slot_indices(plan, transfer)
                    check()
                # a weak reference: ``transfer.staged`` is ``pre``, and a cycle would keep the
                # device copy (and the prefetch budget it holds) until a full collection
                pre.scatter_plan = (weakref.ref(transfer), key, plan, base, idx)
            main = backend.current_stream(self.device)
            backend.wait_event(main, pre.event_for(layers.stop))
            if main != pre.stream:
                backend.record_stream(pre.staging, main)
            if isinstance(idx, KernelIndex):
                assert self.kernels is not None
                staged = pre.staging[base : base + plan.total * plan.row_bytes]
                if verify:
                    return self._verified_scatter(idx, staged, layers, staging_full=True)
                self.kernels.scatter(idx, staged, layers, staging_full=True)
                return self.kernels.checked_before(idx) if checked else True
            views.scatter(plan, pre.staging[base:], full, idx, -1, only=layers)
        return True

    def _verified_scatter(
        self, index: KernelIndex, staging: torch.Tensor, layers: range, *, staging_full: bool
    ) -> LoadChecks:
        """Verify and scatter ``layers`` (all layers: verdicts before the scatter; some: the
        sums of the bytes moved, compared by the engine at the end)."""
        assert self.kernels is not None
        if len(layers) == self.views.num_layers:
            return self.kernels.verified_scatter(index, staging)
        return self.kernels.summed_scatter(index, staging, layers, staging_full=staging_full)

    def _staging_or_none(self, nbytes: int, layers: range) -> torch.Tensor | None:
        """A device staging buffer of ``nbytes``; ``None`` when the device has no room for it
        and the load can go one layer at a time instead (logged once)."""
        try:
            return self.views.new_staging(nbytes)
        except torch.OutOfMemoryError:
            if len(layers) == 1:
                raise
        if not self._staging_oom_logged:
            self._staging_oom_logged = True
            logger.warning(
                "lmcache: no device memory for a %d MiB load staging buffer (it lies outside "
                "vLLM's profiled memory; lower gpu_memory_utilization to leave room); loading "
                "such hits one layer at a time",
                nbytes >> 20,
            )
        return None

    def _layer_by_layer(
        self, layers: range, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> bool:
        """:meth:`load` one layer at a time, each through a ``1 / len(layers)`` staging buffer.
        Per-layer checks are dropped: the engine verifies on the host."""
        moved = False
        for layer in layers:
            moved = bool(self.load(range(layer, layer + 1), chunks, transfer)) or moved
        return moved

    def _kernel_load(
        self, layers: range, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> bool | LoadChecks:
        """A load through the kernels: copy to staging, then verify and scatter.

        All layers go in pieces of whole chunks: piece ``i`` is checked and scattered while piece
        ``i + 1`` comes from the host. A layer range is summed, not checked, in one piece.
        """
        assert self.kernels is not None
        views, backend, kernels = self.views, self.backend, self.kernels
        verify = self._verifying(chunks)
        skip = transfer.skip_tokens
        if len(layers) == views.num_layers:
            plan = views.kernel_plan(layers, chunks, skip)
        else:
            plan = views.staging_plan(layers, chunks, skip, 0)
        if plan.total == 0:
            return False
        with views.stream_ctx(transfer):
            staging = self._staging_or_none(plan.total * plan.row_bytes, layers)
            if staging is None:
                return self._layer_by_layer(layers, chunks, transfer)
            index = kernels.load_index(plan, chunks, transfer)
            side = views.copy_stream(plan, to_host=False)
            if side is None:  # one piece: copy, then verify and scatter
                views.copy_runs(plan, staging, to_host=False)
                if verify:
                    return self._verified_scatter(index, staging, layers, staging_full=False)
                kernels.scatter(index, staging, layers, staging_full=False)
                return True
            backend.wait_stream(side, backend.current_stream(self.device))
            ready = []
            with backend.use_stream(side):
                for piece in range(plan.pieces):
                    views.copy_runs(plan, staging, to_host=False, piece=piece)
                    ready.append(backend.event_after(side))
            spans = piece_spans(plan)
            if verify:
                return kernels.verified_scatter_pieces(index, staging, spans, ready)
            kernels.scatter_pieces(index, staging, spans, ready)
        return True

    def _strided_load(
        self, layers: range, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> bool:
        """A load through the strided views: copy to staging, check the slots, scatter; piece
        ``i`` is scattered while piece ``i + 1`` comes from the host."""
        views, backend = self.views, self.backend
        plan = views.staging_plan(layers, chunks, transfer.skip_tokens, -1)
        if plan.total == 0:
            return False
        with views.stream_ctx(transfer):
            staging = self._staging_or_none(plan.total * plan.row_bytes, layers)
            if staging is None:
                return self._layer_by_layer(layers, chunks, transfer)
            idx, check = views.slot_indices(plan, transfer)
            copy = views.copy_stream(plan, to_host=False)
            if copy is None:
                views.copy_runs(plan, staging, to_host=False)
                check()
                views.scatter(plan, staging, layers, idx, -1)
                return True
            main = backend.current_stream(self.device)
            backend.wait_stream(copy, main)  # staging's memory may have been in use on main
            done = []
            with backend.use_stream(copy):
                for piece in range(plan.pieces):
                    views.copy_runs(plan, staging, to_host=False, piece=piece)
                    done.append(backend.event_after(copy))
            check()
            for piece in range(plan.pieces):
                backend.wait_event(main, done[piece])
                views.scatter(plan, staging, layers, idx, piece)
        return True
