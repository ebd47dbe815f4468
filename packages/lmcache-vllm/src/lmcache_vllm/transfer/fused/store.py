# SPDX-License-Identifier: Apache-2.0
"""Stores of the fused all-layer path: KV out of vLLM's pages into the chunks' host buffers.

A store runs these steps, in this order (:meth:`FusedStore.store`):

1. **Plan.** Lay the chunks out in a chunk-major device staging buffer, in pieces of whole
   chunks, and find the host copies (:mod:`~lmcache_vllm.transfer.fused.plan`). A step's batched
   saves plan ahead, while the step computes (:meth:`FusedStore.prepare`).
2. **Index.** Check every slot on the host and upload the staging tokens' slots.
3. **Gather and sum.** Per piece, one ``gather_kv`` launch on at most ``gather_sms`` SMs copies
   every layer of the piece's chunks into staging. With checksums it sums each chunk's bytes in
   the same pass: the sum guards exactly the bytes the next step copies.
4. **Copy to the host.** The piece's DMAs run on a side stream while the next piece is gathered.
5. **Hand back.** The sums go to the host on the same stream, readable with the bytes. A deferred
   store returns at once (the caller waits); else the store waits here.

Without the one-launch kernels (or with a slot mapping on the device), steps 2-3 go through the
strided views (:class:`~lmcache_vllm.transfer.fused.views.FusedViews`) and one
``checksum_chunks`` launch sums the staged chunks after the gathers.
This module never imports vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from lmcache.gpu_connector.checksums import StoreChecksums
from lmcache.gpu_connector.interface import ChunkTransfer, TransferSpec
from lmcache_vllm.transfer.fused.kernels import ChunkKernels, KernelIndex
from lmcache_vllm.transfer.fused.plan import PreparedStore, StagingPlan, piece_spans
from lmcache_vllm.transfer.fused.views import FusedViews

if TYPE_CHECKING:
    from lmcache.devices import DeviceBackend

__all__ = ["FusedStore"]


def _no_check() -> None:
    """The check of a kernel store's slots: done on the host when its index was built."""


class FusedStore:
    """The stores of one cache (see the module docstring).

    Args:
        views: The cache's views, plans and host copies.
        kernels: The one-launch kernels (a device with streams), else ``None``.
        checksums: Sum each chunk on the device as it is gathered (where the kernels run).
    """

    kernel_gather: bool = True
    """Store through the ``gather_kv`` kernel when it runs as one launch on this device (the
    compiled kernels or their Triton port, :func:`lmcache.gpu_ops.one_launch_ops`): one launch
    for every chunk and the layers stored, each chunk's sum computed in the same pass."""

    def __init__(self, views: FusedViews, kernels: ChunkKernels | None, checksums: bool) -> None:
        self.views = views
        self.kernels = kernels
        self.checksums = checksums
        self.device = views.device

    @property
    def backend(self) -> DeviceBackend:
        """The cache device's backend (the views')."""
        return self.views.backend

    # -- 1-2. plan and index, ahead of the store ----------------------------------------------

    def plans_ahead(self, transfer: TransferSpec) -> bool:
        """Whether :meth:`prepare` can do a store's host side ahead: CUDA, and a slot mapping
        on the host (a device one is checked through a buffer each call reuses)."""
        return self.backend.has_streams and transfer.slot_mapping.device.type == "cpu"

    def prepare(
        self, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> PreparedStore | None:
        """The plan and uploaded slot indices of a later all-layer :meth:`store` of ``chunks``
        (checked by the caller), made now on ``transfer.stream``; ``None`` unless
        :meth:`plans_ahead`."""
        if not self.plans_ahead(transfer):
            return None
        views = self.views
        layers = range(views.num_layers)
        if self.kernels is not None and self._by_kernel(transfer):
            plan = views.kernel_plan(layers, chunks, 0)
            with views.stream_ctx(transfer):
                index = self.kernels.load_index(plan, chunks, transfer)
                uploaded = self.backend.event_after(self.backend.current_stream(self.device))
            return PreparedStore(
                layers, chunks, transfer.slot_mapping, plan, index.slots, _no_check, uploaded,
                kernel_index=index, strided_ready=False,
            )  # fmt: skip
        plan = views.staging_plan(layers, chunks, 0, self._strided_pieces(transfer))
        with views.stream_ctx(transfer):
            idx, check = views.slot_indices(plan, transfer)
            uploaded = self.backend.event_after(self.backend.current_stream(self.device))
        return PreparedStore(layers, chunks, transfer.slot_mapping, plan, idx, check, uploaded)

    def checked_ahead(self, chunks: Sequence[ChunkTransfer], transfer: TransferSpec) -> bool:
        """A copy of the very chunk list and slot mapping that :meth:`prepare` planned
        (checked by its caller; a step's batched saves): no second check of every chunk."""
        prep = transfer.prepared
        return (
            isinstance(prep, PreparedStore)
            and prep.chunks is chunks
            and prep.slots is transfer.slot_mapping
        )

    # -- the store ------------------------------------------------------------------------------

    def store(
        self, layers: range, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> StoreChecksums | None:
        """Copy ``layers`` of the chunks out of the cache (see the module docstring).

        On a device with streams, also sum each chunk's staged bytes of those layers (returned,
        readable with the bytes): with all layers its checksum, with some a part the engine
        adds up.
        """
        deferred = transfer.deferred and transfer.stream is not None and self.backend.has_streams
        if self._by_kernel(transfer) and self._kernel_sums(layers):
            return self._kernel_store(layers, chunks, transfer, deferred)
        return self._strided_store(layers, chunks, transfer, deferred)

    def _by_kernel(self, transfer: TransferSpec) -> bool:
        """Whether stores go through the ``gather_kv`` kernel: it is on and runs as one launch
        here (compiled or Triton), and the slot mapping is on the host (checked there, with no
        sync)."""
        return self.kernel_gather and self.kernels is not None and self.kernels.one_launch(transfer)

    def _kernel_sums(self, layers: range) -> bool:
        """Whether the kernel gives a store of ``layers`` the sums it needs: none (checksums
        off), all layers, or a layer range of whole 64-bit words per token row."""
        whole = len(layers) == self.views.num_layers
        return not self.checksums or whole or self.views.layer_bytes % 8 == 0

    def _kernel_store(
        self,
        layers: range,
        chunks: Sequence[ChunkTransfer],
        transfer: TransferSpec,
        deferred: bool,
    ) -> StoreChecksums | None:
        """Steps 1-5 through the ``gather_kv`` kernel.

        All layers go in pieces of whole chunks, deferred or not: the gather takes at most
        ``gather_sms`` SMs from the model, so each piece's gather overlaps the previous piece's
        DMAs instead of adding to the copy. Some layers (a layerwise store) go in one piece.
        The plan and index a prepared store made are reused (every layer of a layerwise store
        reuses its index).
        """
        assert self.kernels is not None
        kernels, views, backend = self.kernels, self.views, self.backend
        # 1. plan
        prep = transfer.prepared
        if not isinstance(prep, PreparedStore) or prep.kernel_index is None:
            prep = None  # nothing prepared for the kernel
        if prep is not None and prep.matches(layers, chunks, transfer):
            plan = prep.plan
        elif len(layers) == views.num_layers:
            plan = views.kernel_plan(layers, chunks, 0)
        else:
            plan = views.staging_plan(layers, chunks, 0, 0)
        if prep is not None and not prep.indexes(plan, transfer):
            prep = None
        try:
            with views.stream_ctx(transfer):
                # 2. index
                if prep is None:
                    index = kernels.load_index(plan, chunks, transfer)
                else:
                    index = prep.kernel_index
                    backend.wait_event(backend.current_stream(self.device), prep.uploaded)
                staging = views.new_staging(plan.total * plan.row_bytes)
                copy = views.copy_stream(plan, to_host=True)
                if copy is None:
                    # 3. gather and sum, 4. copy to the host: one piece
                    sums = kernels.new_sums(len(index.positions)) if self.checksums else None
                    kernels.gather_layers(index, staging, sums, layers)
                    if transfer.on_engine_read is not None:
                        transfer.on_engine_read()
                    views.copy_runs(plan, staging, to_host=True)
                    checksums = None if sums is None else kernels.sums_to_host(sums)
                else:
                    checksums = self._gather_and_copy_pieces(plan, index, staging, copy, transfer)
            # 5. hand back
            if not deferred:
                views.sync(transfer)
        except BaseException:
            if deferred:  # the caller releases the buffers: no queued copy may still fill them
                views.sync(transfer)
            raise
        return checksums

    def _gather_and_copy_pieces(
        self,
        plan: StagingPlan,
        index: KernelIndex,
        staging: torch.Tensor,
        copy: Any,
        transfer: TransferSpec,
    ) -> StoreChecksums | None:
        """Steps 3-4 in pieces: gather piece ``i + 1`` (summing its chunks) while piece ``i``
        goes to the host on ``copy``; the current stream waits for the copies at the end."""
        assert self.kernels is not None
        kernels, backend = self.kernels, self.backend
        main = backend.current_stream(self.device)
        sums = kernels.new_sums(len(index.positions)) if self.checksums else None
        for piece, span in enumerate(piece_spans(plan)):
            kernels.gather_span(index, staging, sums, span)
            backend.wait_stream(copy, main)
            with backend.use_stream(copy):
                self.views.copy_runs(plan, staging, to_host=True, piece=piece)
        if transfer.on_engine_read is not None:
            transfer.on_engine_read()  # every gather is enqueued
        checksums = None if sums is None else kernels.sums_to_host(sums)
        backend.wait_stream(main, copy)
        return checksums

    def _strided_pieces(self, transfer: TransferSpec) -> int:
        """``piece_bytes`` of a strided store's plan: a deferred store (nobody waits for it) in
        one piece, one gather and its DMAs with no side-stream hops (fewer launches on the save
        thread); else the default pipelining (:meth:`FusedViews.piece_bytes`)."""
        deferred = transfer.deferred and transfer.stream is not None
        return 0 if deferred and self.backend.has_streams else -1

    def _strided_store(
        self,
        layers: range,
        chunks: Sequence[ChunkTransfer],
        transfer: TransferSpec,
        deferred: bool,
    ) -> StoreChecksums | None:
        """Steps 1-5 through the strided views; all layers are summed after the gathers."""
        views, backend = self.views, self.backend
        sums: StoreChecksums | None = None
        summing = self.kernels is not None and self.checksums and len(layers) == views.num_layers
        try:
            # 1. plan
            prep = transfer.prepared
            if not isinstance(prep, PreparedStore):
                prep = None
            elif not prep.strided_ready:  # a kernel store's plan, copied per layer
                self._add_strided_indices(prep, transfer)
            if prep is not None and prep.matches(layers, chunks, transfer):
                plan = prep.plan  # planned while the step computed this KV
            else:
                plan = views.staging_plan(layers, chunks, 0, self._strided_pieces(transfer))
            if prep is not None and not prep.indexes(plan, transfer):
                prep = None
            with views.stream_ctx(transfer):
                # 2. index
                if prep is None:
                    idx, check = views.slot_indices(plan, transfer)
                else:
                    idx, check = prep.idx, prep.check
                    backend.wait_event(backend.current_stream(self.device), prep.uploaded)
                staging = views.new_staging(plan.total * plan.row_bytes)
                copy = views.copy_stream(plan, to_host=True)
                if copy is None:
                    # 3. gather, 4. copy to the host: one piece
                    views.gather(plan, staging, layers, idx, -1)
                    if transfer.on_engine_read is not None:
                        transfer.on_engine_read()
                    if summing:
                        assert self.kernels is not None
                        sums = self.kernels.store_sums(plan, staging)
                    views.copy_runs(plan, staging, to_host=True)
                else:  # gather piece i + 1 while piece i goes to the host
                    main = backend.current_stream(self.device)
                    for piece in range(plan.pieces):
                        views.gather(plan, staging, layers, idx, piece)
                        backend.wait_stream(copy, main)
                        with backend.use_stream(copy):
                            views.copy_runs(plan, staging, to_host=True, piece=piece)
                    if transfer.on_engine_read is not None:
                        transfer.on_engine_read()  # every gather is on main now
                    if summing:
                        assert self.kernels is not None
                        sums = self.kernels.store_sums(plan, staging)
                    backend.wait_stream(main, copy)
            # 5. hand back
            if not deferred:
                views.sync(transfer)
            check()
        except BaseException:
            if deferred:  # the caller releases the buffers: no queued copy may still fill them
                views.sync(transfer)
            raise
        return sums

    def _add_strided_indices(self, prep: PreparedStore, transfer: TransferSpec) -> None:
        """Give a kernel store's plan this path's indices, once (its own are raw slots): a
        layerwise store copies it layer by layer, which the gather kernel does not do."""
        views = self.views
        with views.stream_ctx(transfer):
            prep.idx, prep.check = views.slot_indices(prep.plan, transfer)
            prep.uploaded = self.backend.event_after(self.backend.current_stream(self.device))
        prep.strided_ready = True
