# SPDX-License-Identifier: Apache-2.0
"""The views of one paged cache and the moves both directions share.

:class:`FusedViews` describes one ``kv_concat`` or ``mla`` cache through strided all-layer views.
It lays a call's chunks out in the chunk-major staging buffer (:meth:`FusedViews.staging_plan`).
It gathers tokens into staging and scatters them back with advanced indexing (the path without
the one-launch kernels).
It copies staging to and from the chunks' host buffers through the device backend.
The store (:mod:`~lmcache_vllm.transfer.fused.store`) and the load
(:mod:`~lmcache_vllm.transfer.fused.load`) each hold one.
This module never imports vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from lmcache.gpu_connector.interface import ChunkTransfer, TransferSpec
from lmcache.gpu_connector.layer_range import transfer_stream
from lmcache_vllm.transfer.fused.plan import (
    HostRun,
    StagingOp,
    StagingPlan,
    plan_chunks,
    widen_rows,
)
from lmcache_vllm.transfer.fused.slot_indices import SlotIndices
from lmcache_vllm.transfer.kv_formats import describe
from lmcache_vllm.transfer.paged_cache import PagedKVCache, fuse_layers, wait_for_transfer

if TYPE_CHECKING:
    from lmcache.devices import DeviceBackend

__all__ = ["FusedViews"]

logger = logging.getLogger(__name__)


class FusedViews:
    """The views of one cache and the data moves through them (see the module docstring).

    Args:
        cache: A ``kv_concat`` or ``mla`` cache.
        backend: The cache device's backend: every stream, event, pinned buffer and host copy
            goes through it.
    """

    pipeline_bytes: int = 64 << 20
    """On CUDA, a call is cut into about four pieces of at most this many bytes (and at least
    ``min_piece_bytes``); piece ``i``'s host copy (on a side stream) overlaps piece ``i + 1``'s
    gather or piece ``i - 1``'s scatter. ``0`` runs the gather and the copies back to back on one
    stream."""

    min_piece_bytes: int = 32 << 20
    """Smallest piece: each piece costs a dozen host-side launches, which must stay well under
    its copy time (32 MiB take ~0.6 ms at PCIe 5 speed), so small calls are one piece."""

    kernel_pieces: int = 8
    """On CUDA, a kernel store or verified load is cut into up to this many pieces of whole
    chunks, each at least ``min_piece_bytes``. Piece ``i``'s DMAs (on a side stream) overlap
    piece ``i + 1``'s gather, or piece ``i - 1``'s check and scatter. ``1``: one piece."""

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

    @property
    def num_layers(self) -> int:
        return len(self._caches)

    @property
    def kv_width(self) -> int:
        return self.cache.kv_width

    @property
    def dtype(self) -> torch.dtype:
        return self.cache.dtype

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer of one token."""
        return self.kv_width * self._caches[0].element_size()

    def stream_ctx(self, transfer: TransferSpec) -> Any:
        """The stream context a call runs in (its ``transfer.stream``, else the current one)."""
        return transfer_stream(self.backend, self.device, transfer)

    def sync(self, transfer: TransferSpec) -> None:
        """Wait for the call's stream."""
        wait_for_transfer(self.backend, self.device, transfer)

    def _init_fused(self) -> None:
        # Fused all-layer view (see _setup_fused); None -> the per-layer path.
        self.fused: torch.Tensor | None = None
        self.fused_layers: list[torch.Tensor] | None = None  # one view per layer instead
        self._fused_split = False  # head_k != head_v: rows are [heads, K||V], split on copy
        self._fused_by_slot = False  # _fused is [L, slots, *row], else [L, B, N, *row]
        self._layer_ids = torch.empty(0, dtype=torch.int64)
        self._all_layers = self._layer_ids
        self._copy_streams: dict[bool, Any] = {}  # side stream per direction (to_host)

    def _setup_fused(self) -> None:
        """Build the indexed views of the fused path, ``[..., slot, *row]`` (or ``[..., block,
        offset, *row]``): ``self.fused`` over every layer at once when the layers are views of
        one buffer with a uniform step, else ``self.fused_layers``, one view per layer (vLLM
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
            self.fused = self._row_view(fused, 1)
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
        self.fused_layers = [self._row_view(t, 0) for t in self._caches]

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
    def usable(self) -> bool:
        """Whether the fused path (one view, or one view per layer) is set up."""
        return self.fused is not None or self.fused_layers is not None

    # -- fused path: all layers per op, chunk-major staging ------------------------------------

    def piece_bytes(self, total_bytes: int) -> int:
        """Target bytes per piece on CUDA (0: one piece): about four pieces a call, each at
        most ``pipeline_bytes`` and at least ``min_piece_bytes`` (capped by the former)."""
        cap = self.pipeline_bytes
        if not self.backend.has_streams or cap <= 0:
            return 0
        return max(min(self.min_piece_bytes, cap), min(cap, total_bytes // 4))

    def staging_plan(
        self, layers: range, chunks: Sequence[ChunkTransfer], skip: int, piece_bytes: int = -1
    ) -> StagingPlan:
        """:func:`~lmcache_vllm.transfer.fused.plan.plan_chunks` of this cache (``piece_bytes`` -1:
        :meth:`piece_bytes`)."""
        return plan_chunks(
            layers,
            chunks,
            skip,
            piece_bytes,
            num_layers=self.num_layers,
            layer_bytes=self.layer_bytes,
            default_piece_bytes=self.piece_bytes,
        )

    def kernel_plan(self, layers: range, chunks: Sequence[ChunkTransfer], skip: int) -> StagingPlan:
        """A plan for the kernels, whose pieces hold whole chunks (see :attr:`kernel_pieces`)."""
        plan = self.staging_plan(layers, chunks, skip, 0)
        total = plan.total * plan.row_bytes
        if not self.backend.has_streams or self.kernel_pieces <= 1 or not plan.ops:
            return plan
        biggest = max(op.n for op in plan.ops) * plan.row_bytes  # never cut a chunk by layers
        piece = max(biggest, self.min_piece_bytes, -(-total // self.kernel_pieces))
        return plan if piece >= total else self.staging_plan(layers, chunks, skip, piece)

    def slot_indices(self, plan: StagingPlan, transfer: TransferSpec) -> tuple[torch.Tensor, Any]:
        """:meth:`SlotIndices.build <lmcache_vllm.transfer.fused.slot_indices.SlotIndices.build>`: the
        device indices of ``plan``'s staging tokens and the check to call before trusting a
        scatter."""
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
        if self.fused is not None:
            ref, lead = self.fused, 1  # lead: the layer axis of the one view
        else:
            assert self.fused_layers is not None
            ref, lead = self.fused_layers[0], 0
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

    def gather(
        self, plan: StagingPlan, staging: torch.Tensor, layers: range, idx: torch.Tensor, piece: int
    ) -> None:
        """Gather every op of ``piece`` (all ops when ``piece < 0``) into staging."""
        for op in plan.ops:
            if piece >= 0 and op.piece != piece:
                continue
            tok, out = self._op_views(plan, staging, layers, idx, op)
            a, b = layers.start + op.l0, layers.start + op.l1  # the layers this op holds
            if self.fused is not None:
                self._gather_into(self.fused, [self._layer_index(a, b), *tok], out)
                continue
            assert self.fused_layers is not None
            per_layer = [t.squeeze(1) for t in tok]  # [g, n - t0]
            for j in range(b - a):
                self._gather_into(self.fused_layers[a + j], per_layer, out[:, j])

    def scatter(
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
            if self.fused is not None:
                self.fused.index_put_((self._layer_index(a, b), *tok), src)
                continue
            assert self.fused_layers is not None
            per_layer = tuple(t.squeeze(1) for t in tok)
            for j in range(b - a):
                self.fused_layers[a + j].index_put_(per_layer, src[:, j])

    def copy_runs(
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

    def new_staging(self, nbytes: int) -> torch.Tensor:
        """A device staging buffer of ``nbytes`` on the current stream (raises
        ``torch.OutOfMemoryError`` when the device has no room)."""
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def copy_stream(self, plan: StagingPlan, to_host: bool) -> Any:
        """The side stream for the host copies when ``plan`` has several pieces, else ``None``.

        Stores and loads each have their own: on one stream, a store's copies to the host
        would queue behind a concurrent load's copies to the device, and PCIe runs both ways
        at once.
        """
        if plan.pieces <= 1:
            return None
        stream = self._copy_streams.get(to_host)
        if stream is None:
            stream = self._copy_streams.setdefault(to_host, self.backend.new_stream(self.device))
        return stream

    def close(self) -> None:
        """Drop the views and the pinned index buffers."""
        self._caches = []
        self.fused = None
        self.fused_layers = None
        self._indices.close()
