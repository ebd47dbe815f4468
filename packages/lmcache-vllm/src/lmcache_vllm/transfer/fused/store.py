# SPDX-License-Identifier: Apache-2.0
"""The store side of the fused all-layer path: KV out of vLLM's pages into the chunks.

A store gathers every layer of the chunks into device staging, then copies it to the host.
With checksums on, the ``gather_kv`` kernel sums each chunk in the same pass.
A step's batched saves plan their store ahead (:meth:`FusedStore.prepare_store`), while the
step computes.
This module never imports vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lmcache import gpu_ops
from lmcache.gpu_connector.checksums import StoreChecksums
from lmcache.gpu_connector.interface import ChunkTransfer, TransferSpec
from lmcache_vllm.transfer.fused.plan import PreparedStore, StagingPlan, piece_spans
from lmcache_vllm.transfer.fused.verified_scatter import LoadIndex
from lmcache_vllm.transfer.fused.views import FusedViews

__all__ = ["FusedStore"]


def _no_check() -> None:
    """The check of a kernel store's slots: done on the host when its index was built."""


class FusedStore(FusedViews):
    """The store side of :class:`~lmcache_vllm.transfer.fused.transfer.FusedTransfer`."""

    def _store_pieces(self, transfer: TransferSpec) -> int:
        """``piece_bytes`` of a strided store's plan: a deferred store (nobody waits for it) in
        one piece, one gather and its DMAs with no side-stream hops (fewer launches on the save
        thread); else the default pipelining (:meth:`_piece_bytes`). A kernel store always goes
        in pieces (:meth:`_store_by_kernel`)."""
        deferred = transfer.deferred and transfer.stream is not None
        return 0 if deferred and self.backend.has_streams else -1

    def plans_ahead(self, transfer: TransferSpec) -> bool:
        """Whether :meth:`prepare_store` can do a store's host side ahead: CUDA, and a slot
        mapping on the host (a device one is checked through a buffer each call reuses)."""
        return self.backend.has_streams and transfer.slot_mapping.device.type == "cpu"

    def prepare_store(
        self, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> PreparedStore | None:
        """The host side of a later all-layer :meth:`from_cache` of ``chunks`` (checked by
        the caller), done ahead: the plan, and the slot indices uploaded on ``transfer.stream``;
        ``None`` unless :meth:`plans_ahead`."""
        if not self.plans_ahead(transfer):
            return None
        layers = range(self.num_layers)
        if self._sums is not None and self._kernel_store(transfer):
            plan = self._kernel_plan(layers, chunks, 0)
            with self._stream_ctx(transfer):
                index = self._sums.load_index(plan, chunks, transfer)
                uploaded = self.backend.event_after(self.backend.current_stream(self.device))
            return PreparedStore(
                layers, chunks, transfer.slot_mapping, plan, index.slots, _no_check, uploaded,
                kernel_index=index, strided_ready=False,
            )  # fmt: skip
        plan = self._plan(layers, chunks, 0, self._store_pieces(transfer))
        with self._stream_ctx(transfer):
            idx, check = self._fused_indices(plan, transfer)
            uploaded = self.backend.event_after(self.backend.current_stream(self.device))
        return PreparedStore(layers, chunks, transfer.slot_mapping, plan, idx, check, uploaded)

    def _add_strided_indices(self, prep: PreparedStore, transfer: TransferSpec) -> None:
        """Give a kernel store's plan this path's indices, once (its own are raw slots): a
        layerwise store copies it layer by layer, which the gather kernel does not do."""
        with self._stream_ctx(transfer):
            prep.idx, prep.check = self._fused_indices(prep.plan, transfer)
            prep.uploaded = self.backend.event_after(self.backend.current_stream(self.device))
        prep.strided_ready = True

    def checked_ahead(self, chunks: Sequence[ChunkTransfer], transfer: TransferSpec) -> bool:
        """A copy of the very chunk list and slot mapping that :meth:`prepare_store` planned
        (checked by its caller; a step's batched saves): no second check of every chunk."""
        prep = transfer.prepared
        return (
            isinstance(prep, PreparedStore)
            and prep.chunks is chunks
            and prep.slots is transfer.slot_mapping
        )

    def from_cache(
        self, layers: range, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> StoreChecksums | None:
        """Copy ``layers`` of the chunks out of the cache. On a device with streams, also sum
        each chunk's staged bytes of those layers (returned, readable with the bytes): with all
        layers its checksum, with some a part the engine adds up."""
        backend = self.backend
        sums: StoreChecksums | None = None
        summing = self._sums is not None and self.checksums and len(layers) == self.num_layers
        deferred = transfer.deferred and transfer.stream is not None and backend.has_streams
        if (summing or self._sums_layers() or not self.checksums) and self._kernel_store(transfer):
            return self._store_by_kernel(layers, chunks, transfer, deferred)
        try:
            prep = transfer.prepared
            if not isinstance(prep, PreparedStore):
                prep = None
            elif not prep.strided_ready:  # a kernel store's plan, copied per layer
                self._add_strided_indices(prep, transfer)
            if prep is not None and prep.matches(layers, chunks, transfer):
                plan = prep.plan  # planned while the step computed this KV
            else:
                plan = self._plan(layers, chunks, 0, self._store_pieces(transfer))
            if prep is not None and not prep.indexes(plan, transfer):
                prep = None
            with self._stream_ctx(transfer):
                if prep is None:
                    idx, check = self._fused_indices(plan, transfer)
                else:
                    idx, check = prep.idx, prep.check
                    backend.wait_event(backend.current_stream(self.device), prep.uploaded)
                staging = torch.empty(
                    plan.total * plan.row_bytes, dtype=torch.uint8, device=self.device
                )
                copy = self._copy_stream(plan, to_host=True)
                if copy is None:
                    self._gather(plan, staging, layers, idx, -1)
                    if transfer.on_engine_read is not None:
                        transfer.on_engine_read()
                    if summing:
                        assert self._sums is not None
                        sums = self._sums.store_sums(plan, staging)
                    self._copy_runs(plan, staging, to_host=True)
                else:  # gather piece i + 1 while piece i goes to the host
                    main = backend.current_stream(self.device)
                    for piece in range(plan.pieces):
                        self._gather(plan, staging, layers, idx, piece)
                        backend.wait_stream(copy, main)
                        with backend.use_stream(copy):
                            self._copy_runs(plan, staging, to_host=True, piece=piece)
                    if transfer.on_engine_read is not None:
                        transfer.on_engine_read()  # every gather is on main now
                    if summing:
                        assert self._sums is not None
                        sums = self._sums.store_sums(plan, staging)
                    backend.wait_stream(main, copy)
            if not deferred:
                self._sync(transfer)
            check()
        except BaseException:
            if deferred:  # the caller releases the buffers: no queued copy may still fill them
                self._sync(transfer)
            raise
        return sums

    def _sums_layers(self) -> bool:
        """Whether a store of some layers can sum them on the device: the kernels sum a layer
        range only over whole 64-bit words of each token's row."""
        return (
            self._sums is not None
            and self.checksums
            and self.kv_width * self._caches[0].element_size() % 8 == 0
        )

    def _gather_pieces(
        self,
        plan: StagingPlan,
        index: LoadIndex,
        staging: torch.Tensor,
        copy: Any,
        transfer: TransferSpec,
    ) -> StoreChecksums | None:
        """Gather piece ``i + 1`` (summing its chunks when :attr:`checksums`) while piece ``i``
        goes to the host on ``copy``; the current stream waits for the copies at the end."""
        assert self._sums is not None
        backend = self.backend
        main = backend.current_stream(self.device)
        sums = self._sums.new_sums(len(index.positions)) if self.checksums else None
        for piece, span in enumerate(piece_spans(plan)):
            self._sums.gather_span(index, staging, sums, span)
            backend.wait_stream(copy, main)
            with backend.use_stream(copy):
                self._copy_runs(plan, staging, to_host=True, piece=piece)
        if transfer.on_engine_read is not None:
            transfer.on_engine_read()  # every gather is enqueued
        checksums = None if sums is None else self._sums.sums_to_host(sums)
        backend.wait_stream(main, copy)
        return checksums

    kernel_gather: bool = True
    """Store through the ``gather_kv`` kernel when it runs as one launch on this device (the
    compiled kernels or their Triton port, :func:`lmcache.gpu_ops.one_launch_ops`): one launch
    for every chunk and the layers stored, each chunk's sum computed in the same pass."""

    def _kernel_store(self, transfer: TransferSpec) -> bool:
        """Whether a store goes through :meth:`_store_by_kernel`: the kernel is on and runs as
        one launch here (compiled or Triton), and the slot mapping is on the host (checked
        there, with no sync)."""
        return (
            self.kernel_gather
            and transfer.slot_mapping.device.type == "cpu"
            and gpu_ops.one_launch_ops(self.device)
        )

    def _store_by_kernel(
        self,
        layers: range,
        chunks: Sequence[ChunkTransfer],
        transfer: TransferSpec,
        deferred: bool,
    ) -> StoreChecksums | None:
        """``layers`` of every chunk through the ``gather_kv`` kernel into staging, which sums
        each chunk's bytes of them in the same pass (with :attr:`checksums`), then the DMAs to
        the host. The gather takes at most ``gather_sms`` SMs from the model, so the store
        goes in pieces of whole chunks (:meth:`_kernel_plan`), deferred or not: each piece's
        gather overlaps the previous piece's DMAs instead of adding to the copy.

        All layers: one launch (in pieces when nobody defers it), each chunk's checksum. Some
        layers (a layerwise store): the sums of those layers, which the engine adds up. The
        plan and index a prepared store made are reused (every layer of a layerwise store
        reuses its index).
        """
        assert self._sums is not None
        backend = self.backend
        prep = transfer.prepared
        if not isinstance(prep, PreparedStore) or prep.kernel_index is None:
            prep = None  # nothing prepared for the kernel
        if prep is not None and prep.matches(layers, chunks, transfer):
            plan = prep.plan
        elif len(layers) == self.num_layers:
            plan = self._kernel_plan(layers, chunks, 0)
        else:
            plan = self._plan(layers, chunks, 0, 0)
        if prep is not None and not prep.indexes(plan, transfer):
            prep = None
        try:
            with self._stream_ctx(transfer):
                if prep is None:
                    index = self._sums.load_index(plan, chunks, transfer)
                else:
                    index = prep.kernel_index
                    backend.wait_event(backend.current_stream(self.device), prep.uploaded)
                staging = torch.empty(
                    plan.total * plan.row_bytes, dtype=torch.uint8, device=self.device
                )
                copy = self._copy_stream(plan, to_host=True)
                if copy is None:
                    sums = self._sums.new_sums(len(index.positions)) if self.checksums else None
                    self._sums.gather_layers(index, staging, sums, layers)
                    if transfer.on_engine_read is not None:
                        transfer.on_engine_read()
                    self._copy_runs(plan, staging, to_host=True)
                    checksums = None if sums is None else self._sums.sums_to_host(sums)
                else:
                    checksums = self._gather_pieces(plan, index, staging, copy, transfer)
            if not deferred:
                self._sync(transfer)
        except BaseException:
            if deferred:  # the caller releases the buffers: no queued copy may still fill them
                self._sync(transfer)
            raise
        return checksums
