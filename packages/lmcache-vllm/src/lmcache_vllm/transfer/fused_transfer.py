# SPDX-License-Identifier: Apache-2.0
"""The fused all-layer transfer strategy of
:class:`~lmcache_vllm.transfer.paged_connector.VLLMPagedConnector`.

For ``kv_concat`` and ``mla`` caches whose layers are views of one buffer with a uniform step
between layers (how vLLM allocates them), all layers are gathered/scattered through one strided
``[layers, blocks, block_size, ...]`` view with one advanced-indexing op per run of equal-sized
chunks. Every transfer moves all chunks of a request at once, through one *chunk-major* staging
buffer (on the device when ``config.gpu_staging_buffer``): chunk ``c``'s ``[num_layers, tokens,
kv_width]`` block is contiguous there, so each chunk (or each run of chunks whose host buffers lie
back to back in one pool slab) moves in one copy-engine DMA; the same part of several chunks at a
constant step (a layer group of each chunk) moves in one strided 2D copy (``cudaMemcpy2DAsync``),
and the one-row copies of a piece go in one batched call (``cudaMemcpyBatchAsync`` where the
runtime has it), all through the connector's device backend (:mod:`lmcache.devices`). Slot
indices are built once per call, on the host when the slot mapping is on the host (the adapter's
case: no device sync at all; they go to the device through a persistent pinned buffer),
otherwise on the device.

:class:`FusedTransfer` is built by the connector from the
:class:`~lmcache_vllm.transfer.paged_cache.PagedKVCache` it checked and its device backend
(:meth:`FusedTransfer.for_cache`), and holds everything the path needs (views, index ring, copy
stream); it reads nothing of the connector. Its parts: the staging plan
(:mod:`lmcache_vllm.transfer.fused_plan`), the slot indices (:mod:`lmcache_vllm.transfer.slot_indices`), and here
the views, the gathers and scatters, the host copies, and the store, load and prefetch paths.
This module never imports vLLM.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from lmcache import gpu_ops
from lmcache.gpu_connector.checksums import LoadChecks, StoreChecksums
from lmcache.gpu_connector.interface import ChunkTransfer, TransferSpec
from lmcache.gpu_connector.layer_range import transfer_stream
from lmcache_vllm.transfer.fused_plan import (
    HostRun,
    Prefetched,
    PreparedStore,
    StagingOp,
    StagingPlan,
    add_run,
    plan_chunks,
    widen_rows,
)
from lmcache_vllm.transfer.kv_formats import describe
from lmcache_vllm.transfer.paged_cache import PagedKVCache, fuse_layers, wait_for_transfer
from lmcache_vllm.transfer.slot_indices import SlotIndices
from lmcache_vllm.transfer.verified_scatter import ChunkChecksums, LoadIndex

if TYPE_CHECKING:
    from lmcache.devices import DeviceBackend

__all__ = ["FusedTransfer", "Prefetched"]


def _no_check() -> None:
    """The check of a kernel store's slots: done on the host when its index was built."""


logger = logging.getLogger(__name__)


class FusedTransfer:
    """The fused all-layer path (see the module docstring).

    Args:
        cache: A ``kv_concat`` or ``mla`` cache.
        backend: The cache device's backend: every stream, event, pinned buffer and host copy
            goes through it.

    Use :meth:`for_cache`, which returns ``None`` when the layers allow no fused views.
    """

    pipeline_bytes: int = 64 << 20
    """On CUDA, a call is cut into about four pieces of at most this many bytes (and at least
    ``min_piece_bytes``); piece ``i``'s host copy (on a side stream) overlaps piece ``i + 1``'s
    gather or piece ``i - 1``'s scatter. ``0`` runs the gather and the copies back to back on one
    stream."""

    min_piece_bytes: int = 32 << 20
    """Smallest piece: each piece costs a dozen host-side launches, which must stay well under
    its copy time (32 MiB take ~0.6 ms at PCIe 5 speed), so small calls are one piece."""

    def __init__(self, cache: PagedKVCache, backend: DeviceBackend) -> None:
        self.cache = cache
        self.kv_format = cache.kv_format
        self._caches = list(cache.caches)
        self.block_size = cache.block_size
        self.num_blocks = cache.num_blocks
        self.device = cache.device
        self.backend = backend
        self._init_fused()
        self._setup_fused()
        self._indices = SlotIndices(cache, backend, self._fused_by_slot)
        self._sums: ChunkChecksums | None = None
        if backend.has_streams and self._fused_any:
            self._sums = ChunkChecksums(cache, backend)
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
    def for_cache(cls, cache: PagedKVCache, backend: DeviceBackend) -> FusedTransfer | None:
        """The fused path of ``cache``, or ``None`` when its layers allow neither one view nor
        one view per layer (layers that differ in strides)."""
        fused = cls(cache, backend)
        return fused if fused._fused_any else None

    @property
    def num_layers(self) -> int:
        return len(self._caches)

    @property
    def kv_width(self) -> int:
        return self.cache.kv_width

    @property
    def dtype(self) -> torch.dtype:
        return self.cache.dtype

    def _stream_ctx(self, transfer: TransferSpec) -> Any:
        return transfer_stream(self.backend, self.device, transfer)

    def _sync(self, transfer: TransferSpec) -> None:
        wait_for_transfer(self.backend, self.device, transfer)

    def _init_fused(self) -> None:
        # Fused all-layer view (see _setup_fused); None -> the per-layer path.
        self._fused: torch.Tensor | None = None
        self._fused_layers: list[torch.Tensor] | None = None  # one view per layer instead
        self._fused_split = False  # head_k != head_v: rows are [heads, K||V], split on copy
        self._fused_by_slot = False  # _fused is [L, slots, *row], else [L, B, N, *row]
        self._layer_ids = torch.empty(0, dtype=torch.int64)
        self._all_layers = self._layer_ids
        self._copy_stream_obj: Any = None

    def _setup_fused(self) -> None:
        """Build the indexed views of the fused path, ``[..., slot, *row]`` (or ``[..., block,
        offset, *row]``): ``self._fused`` over every layer at once when the layers are views of
        one buffer with a uniform step, else ``self._fused_layers``, one view per layer (vLLM
        versions that allocate each layer's cache separately), when all layers share strides.

        ``mla``: ``[B, N, latent]``. ``kv_concat``: ``[B, N, 2, H, head]`` when K and V heads are
        equal (so one gathered row is already the canonical ``[all K, all V]``), else ``[B, N,
        H, head_k + head_v]``. Rows are widened to 16-byte elements when the strides allow (same
        bytes, fewer elements for the index kernels), and ``B, N`` merge into one slot axis
        when their strides allow (FlashAttention's LBNHC, MLA).
        """
        md = self.cache
        self._fused_split = self.kv_format != "mla" and md.head_size_k != md.head_size_v
        fused = fuse_layers(self._caches)
        if fused is not None:
            self._fused = self._row_view(fused, 1)
            self._layer_ids = torch.arange(self.num_layers, dtype=torch.int64, device=self.device)
            self._all_layers = self._layer_ids.view(1, -1, 1)
            return
        first = self._caches[0]
        if any(t.stride() != first.stride() for t in self._caches[1:]):
            logger.info(
                "lmcache: vLLM KV layers differ in strides (layer 0: %s); gathering layer by "
                "layer, token by token",
                describe(first),
            )
            return
        self._fused_layers = [self._row_view(t, 0) for t in self._caches]

    def _row_view(self, t: torch.Tensor, lead: int) -> torch.Tensor:
        """``t`` (``[*lead, B, H, N, C]``, MLA ``[*lead, B, N, D]``) as ``[*lead, slots, *row]``
        or ``[*lead, B, N, *row]`` with canonical rows (see :meth:`_setup_fused`)."""
        md = self.cache
        view = t
        if self.kv_format != "mla":
            view = view.transpose(-3, -2)  # [*lead, B, N, H, C]
            if not self._fused_split:
                view = view.unflatten(-1, (2, md.head_size_k)).transpose(-3, -2)  # type: ignore[no-untyped-call]
        if not self._fused_split:
            view = widen_rows(view, self.kv_width * t.element_size())
        try:  # [*lead, slots, *row]: one index per token instead of (block, offset)
            merged = view.view(*view.shape[:lead], -1, *view.shape[lead + 2 :])
        except RuntimeError:  # blocks and offsets do not merge (e.g. LBHNC)
            self._fused_by_slot = False
            return view
        self._fused_by_slot = True
        return merged

    @property
    def _fused_any(self) -> bool:
        """Whether the fused path (one view, or one view per layer) is set up."""
        return self._fused is not None or self._fused_layers is not None

    # -- fused path: all layers per op, chunk-major staging ------------------------------------

    def _piece_bytes(self, total_bytes: int) -> int:
        """Target bytes per piece on CUDA (0: one piece): about four pieces a call, each at
        most ``pipeline_bytes`` and at least ``min_piece_bytes`` (capped by the former)."""
        cap = self.pipeline_bytes
        if not self.backend.has_streams or cap <= 0:
            return 0
        return max(min(self.min_piece_bytes, cap), min(cap, total_bytes // 4))

    def _plan(
        self, layers: range, chunks: Sequence[ChunkTransfer], skip: int, piece_bytes: int = -1
    ) -> StagingPlan:
        """:func:`~lmcache_vllm.transfer.fused_plan.plan_chunks` of this cache (``piece_bytes`` -1:
        :meth:`_piece_bytes`)."""
        return plan_chunks(
            layers,
            chunks,
            skip,
            piece_bytes,
            num_layers=self.num_layers,
            layer_bytes=self.kv_width * self._caches[0].element_size(),
            default_piece_bytes=self._piece_bytes,
        )

    def _fused_indices(self, plan: StagingPlan, transfer: TransferSpec) -> tuple[torch.Tensor, Any]:
        """:meth:`SlotIndices.build <lmcache_vllm.transfer.slot_indices.SlotIndices.build>`: the device
        indices of ``plan``'s staging tokens and the check to call before trusting a scatter."""
        return self._indices.build(plan, transfer)

    def _op_views(
        self,
        plan: StagingPlan,
        staging: torch.Tensor,
        layers: range,
        idx: torch.Tensor,
        op: StagingOp,
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """``(token index tensors [g, 1, n - t0] each, staging view [g, layers, n - t0, *row])``
        of one op."""
        if self._fused is not None:
            ref, lead = self._fused, 1  # lead: the layer axis of the one view
        else:
            assert self._fused_layers is not None
            ref, lead = self._fused_layers[0], 0
        nl = op.l1 - op.l0
        tok = idx[:, op.pos : op.pos + op.g * op.n]
        if op.t0:
            tok = tok.view(-1, op.g, op.n)[:, :, op.t0 :]
        tok = tok.view(-1, op.g, 1, op.n - op.t0)
        lo = op.pos * plan.row_bytes + op.l0 * op.n * plan.layer_bytes
        region = staging[lo : lo + op.g * op.n * nl * plan.layer_bytes]
        if self._fused_split:
            view = region.view(self.dtype).view(op.g, nl, op.n, self.kv_width)
        else:
            skip = lead + (1 if self._fused_by_slot else 2)
            view = region.view(ref.dtype).view(op.g, nl, op.n, *ref.shape[skip:])
        if op.t0:
            view = view[:, :, op.t0 :]
        return list(tok.unbind(0)), view

    def _layer_index(self, a: int, b: int) -> torch.Tensor:
        """Layer index ``[1, b - a, 1]`` of layers ``a .. b - 1`` on the one-view path."""
        if b - a == self.num_layers:
            return self._all_layers
        return self._layer_ids[a:b].view(1, -1, 1)

    def _split_kv(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[..., kv_width]`` -> K ``[..., H, head_k]`` and V ``[..., H, head_v]`` views."""
        md = self.cache
        nk = md.num_kv_heads * md.head_size_k
        k = rows[..., :nk].unflatten(-1, (md.num_kv_heads, md.head_size_k))  # type: ignore[no-untyped-call]
        v = rows[..., nk:].unflatten(-1, (md.num_kv_heads, md.head_size_v))  # type: ignore[no-untyped-call]
        return k, v

    def _gather_into(self, src: torch.Tensor, index: list[torch.Tensor], out: torch.Tensor) -> None:
        if self._fused_split:
            rows = src[tuple(index)]  # [..., H, head_k + head_v]
            k, v = self._split_kv(out)
            k.copy_(rows[..., : self.cache.head_size_k])
            v.copy_(rows[..., self.cache.head_size_k :])
        else:
            torch.ops.aten.index.Tensor_out(src, index, out=out)

    def _gather(
        self, plan: StagingPlan, staging: torch.Tensor, layers: range, idx: torch.Tensor, piece: int
    ) -> None:
        """Gather every op of ``piece`` (all ops when ``piece < 0``) into staging."""
        for op in plan.ops:
            if piece >= 0 and op.piece != piece:
                continue
            tok, out = self._op_views(plan, staging, layers, idx, op)
            a, b = layers.start + op.l0, layers.start + op.l1  # the layers this op holds
            if self._fused is not None:
                self._gather_into(self._fused, [self._layer_index(a, b), *tok], out)
                continue
            assert self._fused_layers is not None
            per_layer = [t.squeeze(1) for t in tok]  # [g, n - t0]
            for j in range(b - a):
                self._gather_into(self._fused_layers[a + j], per_layer, out[:, j])

    def _scatter(
        self,
        plan: StagingPlan,
        staging: torch.Tensor,
        layers: range,
        idx: torch.Tensor,
        piece: int,
        only: range | None = None,
    ) -> None:
        """Scatter every op of ``piece`` (all ops when ``piece < 0``) into the cache; ``only``:
        just these layers of the staged ``layers``."""
        for op in plan.ops:
            if piece >= 0 and op.piece != piece:
                continue
            tok, src = self._op_views(plan, staging, layers, idx, op)
            a, b = layers.start + op.l0, layers.start + op.l1  # the layers this op holds
            if only is not None:
                lo, hi = max(a, only.start), min(b, only.stop)
                if lo >= hi:
                    continue
                src = src[:, lo - a : hi - a]
                a, b = lo, hi
            if self._fused_split:
                src = torch.cat(self._split_kv(src), dim=-1)
            if self._fused is not None:
                self._fused.index_put_((self._layer_index(a, b), *tok), src)
                continue
            assert self._fused_layers is not None
            per_layer = tuple(t.squeeze(1) for t in tok)
            for j in range(b - a):
                self._fused_layers[a + j].index_put_(per_layer, src[:, j])

    def _copy_runs(
        self, plan: StagingPlan, staging: torch.Tensor, to_host: bool, piece: int = -1
    ) -> None:
        """Enqueue the host copies of ``plan`` (of ``piece``; all when ``piece < 0``) on the
        current stream: the contiguous one-row runs in one batched copy, strided runs as 2D
        copies, non-contiguous host tensors through a view of their shape."""
        backend = self.backend
        stream = backend.current_stream(self.device)
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        for r in plan.runs:
            if piece >= 0 and r.piece != piece:
                continue
            if r.rows > 1:
                self._copy_2d(r, staging, to_host, stream)
                continue
            dev = staging[r.lo : r.lo + r.nbytes]
            host = r.host_view()
            if not r.contiguous:
                dev = dev.view(self.dtype).view(host.shape)
                if to_host:
                    backend.copy(host, dev, stream)
                else:
                    backend.copy(dev, host, stream)
                continue
            dsts.append(host if to_host else dev)
            srcs.append(dev if to_host else host)
        if dsts:
            backend.copy_batch(dsts, srcs, stream)

    def _copy_2d(self, r: HostRun, staging: torch.Tensor, to_host: bool, stream: Any) -> None:
        """A strided run: ``r.rows`` rows of ``r.nbytes``, one 2D copy (row by row where the
        device has none)."""
        host = r.host.reshape(-1).view(torch.uint8)  # starts at row 0; all rows in its storage
        dev = staging[r.lo :]
        if to_host:
            self.backend.copy_2d(host, r.host_pitch, dev, r.dev_pitch, r.nbytes, r.rows, stream)
        else:
            self.backend.copy_2d(dev, r.dev_pitch, host, r.host_pitch, r.nbytes, r.rows, stream)

    _staging_oom_logged = False

    def _new_staging(self, nbytes: int) -> torch.Tensor:
        """A device staging buffer of ``nbytes`` on the current stream (raises
        ``torch.OutOfMemoryError`` when the device has no room)."""
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def _copy_stream(self, plan: StagingPlan) -> Any:
        """The side stream for the host copies when ``plan`` has several pieces, else ``None``."""
        if plan.pieces <= 1:
            return None
        if self._copy_stream_obj is None:
            self._copy_stream_obj = self.backend.new_stream(self.device)
        return self._copy_stream_obj

    def _store_pieces(self, transfer: TransferSpec) -> int:
        """``piece_bytes`` of a store's plan: a deferred store (nobody waits for it) in one
        piece, one gather and its DMAs with no side-stream hops (fewer launches on the save
        thread); else the default pipelining (:meth:`_piece_bytes`)."""
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
            plan = self._plan(layers, chunks, 0, 0)
            with self._stream_ctx(transfer):
                index = self._sums.load_index(plan, chunks, transfer)
                uploaded = self.backend.event_after(self.backend.current_stream(self.device))
            return PreparedStore(
                layers, chunks, transfer.slot_mapping, plan, index.slots, _no_check, uploaded,
                kernel_index=index,
            )  # fmt: skip
        plan = self._plan(layers, chunks, 0, self._store_pieces(transfer))
        with self._stream_ctx(transfer):
            idx, check = self._fused_indices(plan, transfer)
            uploaded = self.backend.event_after(self.backend.current_stream(self.device))
        return PreparedStore(layers, chunks, transfer.slot_mapping, plan, idx, check, uploaded)

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
        """Copy ``layers`` of the chunks out of the cache; with all layers on a device with
        streams, also sum each chunk's staged bytes (returned, readable with the bytes)."""
        backend = self.backend
        sums: StoreChecksums | None = None
        summing = self._sums is not None and len(layers) == self.num_layers
        deferred = transfer.deferred and transfer.stream is not None and backend.has_streams
        if summing and self._kernel_store(transfer):
            return self._store_by_kernel(layers, chunks, transfer, deferred)
        try:
            prep = transfer.prepared
            if not isinstance(prep, PreparedStore):
                prep = None
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
                copy = self._copy_stream(plan)
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

    kernel_gather: bool = True
    """Store all layers through the ``gather_kv`` kernel when the extension is loaded: one
    launch for every chunk and layer, each chunk's checksum computed in the same pass."""

    def _kernel_store(self, transfer: TransferSpec) -> bool:
        """Whether a store of all layers goes through :meth:`_store_by_kernel`: the kernel is
        on and loaded, and the slot mapping is on the host (checked there, with no sync)."""
        return (
            self.kernel_gather
            and transfer.slot_mapping.device.type == "cpu"
            and gpu_ops.uses_cext(self.device)
        )

    def _store_by_kernel(
        self,
        layers: range,
        chunks: Sequence[ChunkTransfer],
        transfer: TransferSpec,
        deferred: bool,
    ) -> StoreChecksums:
        """All layers of every chunk: one ``gather_kv`` launch into staging that also sums
        each chunk, then the DMAs to the host (their plan prepared ahead when it was)."""
        assert self._sums is not None
        backend = self.backend
        prep = transfer.prepared
        index = None
        if isinstance(prep, PreparedStore) and prep.matches(layers, chunks, transfer):
            plan = prep.plan
            index = prep.kernel_index
        else:
            prep = None
            plan = self._plan(layers, chunks, 0, 0)
        try:
            with self._stream_ctx(transfer):
                if index is None:
                    index = self._sums.load_index(plan, chunks, transfer)
                elif prep is not None:
                    backend.wait_event(backend.current_stream(self.device), prep.uploaded)
                staging = torch.empty(
                    plan.total * plan.row_bytes, dtype=torch.uint8, device=self.device
                )
                sums = self._sums.gather_with_sums(index, staging)
                if transfer.on_engine_read is not None:
                    transfer.on_engine_read()
                self._copy_runs(plan, staging, to_host=True)
            if not deferred:
                self._sync(transfer)
        except BaseException:
            if deferred:  # the caller releases the buffers: no queued copy may still fill them
                self._sync(transfer)
            raise
        return sums

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
        plan = self._plan(full, chunks, 0, piece_bytes=0)
        grouped = (  # groups that tile every layer in order; anything else: one copy
            len(groups) > 1
            and groups[0].start == 0
            and groups[-1].stop == full.stop
            and all(g.step == 1 and g.start < g.stop for g in groups)
            and all(x.stop == y.start for x, y in itertools.pairwise(groups))
        )
        layer_events: list[tuple[int, Any]] = []
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
            else:
                self._copy_runs(plan, staging, to_host=False)
                event = backend.event_after(stream)
        offsets, pos = [], 0
        for start, end, _ in plan.staged:
            offsets.append(pos * plan.row_bytes)
            pos += end - start
        return Prefetched(staging, plan.staged, offsets, event, stream, layer_events)

    def _fused_to_staged(
        self, layers: range, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> bool | LoadChecks:
        """Scatter ``layers`` from ``transfer.staged`` when it covers the chunks (waiting only
        for the copy of those layers); ``False``: not used. Chunks with checksums are verified
        on the device (:meth:`_verify`)."""
        pre = transfer.staged
        backend = self.backend
        if not isinstance(pre, Prefetched) or not backend.has_streams:
            return False
        full = range(self.num_layers)
        key = [(c.start, c.end, c.buffer.data_ptr()) for c in chunks]
        cached = pre.scatter_plan
        verify = self._verifying(chunks)
        with self._stream_ctx(transfer):
            if cached is not None and cached[0] is transfer and cached[1] == key:
                plan, base, idx = cached[2:]  # checked when first built
            else:
                plan = self._plan(full, chunks, transfer.skip_tokens, piece_bytes=0)
                found = pre.base_for(plan)
                if found is None:
                    return False
                base = found
                if verify:
                    assert self._sums is not None
                    idx = self._sums.load_index(plan, chunks, transfer)
                else:
                    idx, check = self._fused_indices(plan, transfer)
                    check()
                pre.scatter_plan = (transfer, key, plan, base, idx)
            main = backend.current_stream(self.device)
            backend.wait_event(main, pre.event_for(layers.stop))
            if main != pre.stream:
                backend.record_stream(pre.staging, main)
            if isinstance(idx, LoadIndex):
                staged = pre.staging[base : base + plan.total * plan.row_bytes]
                return self._verify(idx, staged, layers, staging_full=True)
            self._scatter(plan, pre.staging[base:], full, idx, -1, only=layers)
        return True

    def verify_chunks(
        self, chunks: Sequence[ChunkTransfer], stream: Any, prefetched: Prefetched | None
    ) -> list[bool] | None:
        """Check whole chunks against their ``checksum`` on the device now, on ``stream``, and
        wait (``None``: this path computes no checksums). A ``prefetched`` copy that holds the
        chunks from its first one on is checked in place, after its copy."""
        if self._sums is None or not chunks:
            return None
        staged = None
        if prefetched is not None and prefetched.chunks[: len(chunks)] == [
            (c.start, c.end, c.buffer.data_ptr()) for c in chunks
        ]:
            self.backend.wait_event(stream, prefetched.event)
            self.backend.record_stream(prefetched.staging, stream)
            staged = (prefetched.staging, prefetched.offsets)
        return self._sums.verify_chunks(chunks, stream, staged)

    def _verifying(self, chunks: Sequence[ChunkTransfer]) -> bool:
        """Whether a load of ``chunks`` goes through the verified scatter (checksums on the
        device, and at least one chunk has a stored sum)."""
        return self._sums is not None and any(c.checksum is not None for c in chunks)

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
        # verified: one piece, since every byte of a chunk must be in before its check
        plan = self._plan(layers, chunks, transfer.skip_tokens, 0 if verify else -1)
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
            if verify:
                assert self._sums is not None
                index = self._sums.load_index(plan, chunks, transfer)
                self._copy_runs(plan, staging, to_host=False)
                return self._verify(index, staging, layers, staging_full=False)
            idx, check = self._fused_indices(plan, transfer)
            copy = self._copy_stream(plan)
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

    def close(self) -> None:
        """Drop the views and the pinned index buffers."""
        self._caches = []
        self._fused = None
        self._fused_layers = None
        self._indices.close()
