# SPDX-License-Identifier: Apache-2.0
"""The fused all-layer transfer strategy of :class:`~lmcache_vllm.gpu_connector.VLLMPagedConnector`.

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
:class:`~lmcache_vllm.paged_cache.PagedKVCache` it checked and its device backend
(:meth:`FusedTransfer.for_cache`), and holds everything the path needs (views, index ring, copy
stream); it reads nothing of the connector. This module never imports vLLM.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from lmcache.gpu_connector.interface import ChunkTransfer, TransferSpec
from lmcache.gpu_connector.layer_range import transfer_stream
from lmcache_vllm.kv_formats import describe
from lmcache_vllm.paged_cache import PagedKVCache, fuse_layers, wait_for_transfer

if TYPE_CHECKING:
    from lmcache.devices import DeviceBackend

__all__ = ["FusedTransfer", "Prefetched"]

logger = logging.getLogger(__name__)


_WIDE = ((16, torch.complex128), (8, torch.int64), (4, torch.int32), (2, torch.int16))


def _widen(t: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """``t`` reinterpreted with the widest element that fits (fewer, larger elements for the
    index kernels, which copy elements as opaque bytes), keeping ``row_bytes`` whole."""
    isz = t.element_size()
    for w, dt in _WIDE:
        if w <= isz:
            break
        if row_bytes % w or (t.shape[-1] * isz) % w:
            continue
        try:
            return t.view(dt)
        except RuntimeError:
            continue
    return t


@dataclass
class _Op:
    """One gather/scatter: ``g`` consecutive staged chunks of ``n`` tokens from staging token
    ``pos``, layers ``[l0, l1)`` of the call's layers, tokens ``[t0, n)`` of each chunk."""

    pos: int
    g: int
    n: int
    t0: int
    l0: int
    l1: int
    piece: int


@dataclass
class _Run:
    """Staging bytes ``[lo, lo + nbytes)`` <-> host bytes, moved with one copy.

    ``host`` is the first chunk's host tensor; ``count`` chunks lie back to back after it in one
    storage when ``count > 1`` (see :meth:`host_view`). A non-contiguous host tensor is copied
    through a staging view of its shape.

    ``rows`` > 1 makes it a strided (2D) run: ``rows`` copies of ``nbytes`` each, row ``i`` at
    staging byte ``lo + i * dev_pitch`` and host byte ``host.data_ptr() + i * host_pitch``, all in
    one host storage (e.g. layer group ``g`` of chunks that lie at a constant step in a pool
    slab). On CUDA it moves in one ``cudaMemcpy2DAsync``; ``row_hosts`` keeps each row's host
    tensor for the row-by-row fallback.
    """

    lo: int
    nbytes: int
    host: torch.Tensor
    contiguous: bool
    end_ptr: int
    storage_ptr: int
    piece: int
    count: int = 1
    rows: int = 1
    host_pitch: int = 0
    dev_pitch: int = 0
    row_hosts: list[torch.Tensor] = field(default_factory=list)

    def host_view(self) -> torch.Tensor:
        if not self.contiguous:
            return self.host
        flat = self.host.reshape(-1).view(torch.uint8)
        if self.count == 1:
            return flat
        return flat.as_strided((self.nbytes,), (1,), flat.storage_offset())

    def extend_2d(self, lo: int, nbytes: int, host: torch.Tensor, sptr: int) -> bool:
        """Append ``host`` as the next row of this run when it continues the run's steps on
        both sides (the second row sets them); ``False``: not a continuation."""
        if (
            not self.contiguous
            or self.count != 1
            or nbytes != self.nbytes
            or sptr != self.storage_ptr
            or not host.is_contiguous()
        ):
            return False
        first = self.host.data_ptr()
        ptr = host.data_ptr()
        if self.rows == 1:
            hp, dp = ptr - first, lo - self.lo
            if hp < nbytes or dp < nbytes:  # rows must not overlap (and go forwards)
                return False
            self.host_pitch, self.dev_pitch = hp, dp
            self.row_hosts = [self.host]
        elif (
            ptr != first + self.rows * self.host_pitch or lo != self.lo + self.rows * self.dev_pitch
        ):
            return False
        self.rows += 1
        self.row_hosts.append(host)
        self.end_ptr = ptr + nbytes
        return True


@dataclass
class _Plan:
    """Where the chunks of one call lie in the chunk-major staging buffer, and what moves.

    Staged chunk ``i`` owns staging tokens ``[pos_i, pos_i + n_i)`` and bytes ``[pos_i *
    row_bytes, (pos_i + n_i) * row_bytes)``, laid out ``[layers, n_i, kv_width]``. Ops and runs
    are grouped into ``pieces``: piece ``i``'s host copies may overlap piece ``i + 1``'s gather
    (or piece ``i - 1``'s scatter).
    """

    row_bytes: int
    layer_bytes: int  # bytes of one layer of one token
    tokens: list[tuple[int, int]]  # request token ranges of the staged chunks, in order
    total: int = 0
    ops: list[_Op] = field(default_factory=list)
    kept: list[tuple[int, int]] = field(default_factory=list)  # staging spans that move
    runs: list[_Run] = field(default_factory=list)
    pieces: int = 0
    staged: list[tuple[int, int, int]] = field(default_factory=list)  # (start, end, buffer ptr)

    def token_ids(self) -> torch.Tensor:
        """``[total]`` int64: request token index of every staging token."""
        return torch.cat([torch.arange(a, b) for a, b in self.tokens])

    def kept_positions(self) -> torch.Tensor:
        return torch.cat([torch.arange(a, b) for a, b in self.kept])


@dataclass
class Prefetched:
    """A device copy of whole chunks, all layers, in the chunk-major staging layout.

    Made by :meth:`FusedTransfer.prefetch` on ``stream``; complete once ``event`` is. A later
    load whose staged chunks are a run of these (same token ranges, same host buffers) scatters
    from ``staging`` instead of copying from the host. Copied in layer groups, ``layer_events``
    holds ``(layer stop, event)`` per group, in order: a load of layers ``< stop`` waits only
    for that group's event.
    """

    staging: torch.Tensor
    chunks: list[tuple[int, int, int]]  # (start, end, host buffer ptr) of each chunk
    offsets: list[int]  # byte offset of each chunk in staging
    event: Any
    stream: Any
    layer_events: list[tuple[int, Any]] = field(default_factory=list)
    # (transfer, chunk ranges and buffers) -> (plan, base, device indices) of the last load from
    # this copy: a layerwise load scatters it in several layer groups with the same indices
    scatter_plan: tuple[Any, ...] | None = None

    def event_for(self, stop: int) -> Any:
        """The event after which layers ``0 .. stop - 1`` of every chunk are on the device."""
        for group_stop, event in self.layer_events:
            if group_stop >= stop:
                return event
        return self.event

    def base_for(self, plan: _Plan) -> int | None:
        """Byte offset in ``staging`` of ``plan``'s first staged chunk, or ``None`` unless the
        plan's staged chunks are consecutive chunks of this copy."""
        if not plan.staged:
            return None
        try:
            i = self.chunks.index(plan.staged[0])
        except ValueError:
            return None
        if self.chunks[i : i + len(plan.staged)] != plan.staged:
            return None
        return self.offsets[i]


@dataclass
class _PreparedFrom:
    """A store's plan and device slot indices, made by :meth:`FusedTransfer.prepare_store`
    before the KV exists; valid for a copy of all layers of the same chunk list and slot
    mapping. ``uploaded``: CUDA event after the indices' upload."""

    layers: range
    chunks: Sequence[ChunkTransfer]
    slots: torch.Tensor
    plan: _Plan
    idx: torch.Tensor
    check: Callable[[], None]
    uploaded: Any

    def matches(
        self, layers: range, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> bool:
        """Whether the plan is the one of this call (all of it is reused)."""
        return (
            self.chunks is chunks and self.slots is transfer.slot_mapping and self.layers == layers
        )

    def indexes(self, plan: _Plan, transfer: TransferSpec) -> bool:
        """Whether the indices fit ``plan`` (the same chunks and slots; the layers may differ:
        a layerwise store uploads them once for all of its layers)."""
        return (
            self.slots is transfer.slot_mapping
            and self.plan.staged == plan.staged
            and self.plan.kept == plan.kept
        )


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
        # Persistent pinned host buffers (CUDA): index upload and the slot-range answer.
        self._pinned_idx: list[list[Any]] = []  # ring of [pinned int64 buffer, upload event]
        self._pinned_lo_hi: torch.Tensor | None = None
        # A store may be planned (prepare_store) on one thread while a load runs on another:
        # taking a ring slot, filling it and recording its upload is one step under this lock.
        self._ring_lock = threading.Lock()

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
            view = _widen(view, self.kv_width * t.element_size())
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
    ) -> _Plan:
        """Lay the chunks that move out in the staging buffer (chunk-major) and find the host
        copies: one per chunk, merged when host buffers lie back to back in one storage.

        ``piece_bytes``: cut into pieces of about this size (0: one piece; -1: the default,
        :meth:`_piece_bytes`); a chunk larger than a piece is cut by layers.
        """
        nl = len(layers)
        layer_bytes = self.kv_width * self._caches[0].element_size()
        row_bytes = nl * layer_bytes
        plan = _Plan(row_bytes, layer_bytes, [])
        staged = []
        for c in chunks:
            t0 = min(max(skip - c.start, 0), c.num_tokens)
            if t0 < c.num_tokens:  # else the engine holds all of this chunk already
                staged.append((c, t0))
        if piece_bytes < 0:
            piece_bytes = self._piece_bytes(sum(c.num_tokens for c, _ in staged) * row_bytes)
        whole = layers.start == 0 and layers.stop == self.num_layers
        pos, piece, fill = 0, -1, 0
        for c, t0 in staged:
            n = c.num_tokens
            plan.staged.append((c.start, c.end, c.buffer.data_ptr()))
            if plan.tokens and plan.tokens[-1][1] == c.start:
                plan.tokens[-1] = (plan.tokens[-1][0], c.end)
            else:
                plan.tokens.append((c.start, c.end))
            if plan.kept and plan.kept[-1][1] == pos + t0:
                plan.kept[-1] = (plan.kept[-1][0], pos + n)
            else:
                plan.kept.append((pos + t0, pos + n))
            nbytes = n * row_bytes
            host = c.buffer if whole else c.buffer[layers.start : layers.stop]
            if piece_bytes > 0 and nbytes > piece_bytes and nl > 1:  # cut this chunk by layers
                k = min(nl, -(-nbytes // piece_bytes))
                bounds = [nl * i // k for i in range(k + 1)]
                for l0, l1 in itertools.pairwise(bounds):
                    piece += 1
                    plan.ops.append(_Op(pos, 1, n, t0, l0, l1, piece))
                    self._add_run(
                        plan,
                        pos * row_bytes + l0 * n * layer_bytes,
                        (l1 - l0) * n * layer_bytes,
                        host[l0:l1],
                        piece,
                    )
                fill = piece_bytes  # the next chunk starts a new piece
            else:
                if piece < 0 or (piece_bytes > 0 and fill + nbytes > piece_bytes and fill > 0):
                    piece, fill = piece + 1, 0
                fill += nbytes
                last = plan.ops[-1] if plan.ops else None
                if (
                    last is not None
                    and last.piece == piece
                    and t0 == 0
                    and last.t0 == 0
                    and last.n == n
                    and last.l1 - last.l0 == nl
                ):
                    last.g += 1
                else:
                    plan.ops.append(_Op(pos, 1, n, t0, 0, nl, piece))
                self._add_run(plan, pos * row_bytes, nbytes, host, piece)
            pos += n
        plan.total = pos
        plan.pieces = piece + 1
        return plan

    @staticmethod
    def _add_run(plan: _Plan, lo: int, nbytes: int, host: torch.Tensor, piece: int) -> None:
        contiguous = host.is_contiguous()
        ptr = host.data_ptr()
        sptr = host.untyped_storage().data_ptr() if contiguous else 0
        last = plan.runs[-1] if plan.runs else None
        if (
            contiguous
            and last is not None
            and last.contiguous
            and last.rows == 1
            and last.piece == piece
            and last.end_ptr == ptr
            and last.storage_ptr == sptr
            and last.lo + last.nbytes == lo
        ):
            last.nbytes += nbytes
            last.end_ptr += nbytes
            last.count += 1
            return
        if (
            contiguous
            and last is not None
            and last.piece == piece
            and last.extend_2d(lo, nbytes, host, sptr)
        ):
            return
        plan.runs.append(_Run(lo, nbytes, host, contiguous, ptr + nbytes, sptr, piece))

    def _fused_indices(self, plan: _Plan, transfer: TransferSpec) -> tuple[torch.Tensor, Any]:
        """``(indices, check)``: ``[1, total]`` slots or ``[2, total]`` (block, offset) of the
        staging tokens, int64 on the device (see ``_fused_by_slot``).

        A host slot mapping is checked here, before anything is queued, and its indices go to
        the device in one pinned copy (no sync). A device slot mapping is checked on the device:
        ``check()`` raises ``ValueError`` for a bad slot once the device has answered (call it
        before trusting a scatter); until then slots are clamped so no access goes out of bounds.
        """
        sm = transfer.slot_mapping
        if len(plan.tokens) == 1:
            a, b = plan.tokens[0]
            slots = sm[a:b]
        else:
            slots = sm[plan.token_ids().to(sm.device)]
        bs, limit = self.block_size, self.num_blocks * self.block_size
        if len(plan.kept) == 1 and plan.kept[0] == (0, plan.total):
            kept_pos: Any = None
        elif len(plan.kept) == 1:
            kept_pos = slice(*plan.kept[0])
        else:
            kept_pos = plan.kept_positions()

        def token_ids() -> torch.Tensor:
            ids = plan.token_ids()
            return ids if kept_pos is None else ids[kept_pos]

        rows = 1 if self._fused_by_slot else 2
        if slots.device.type == "cpu" or self.device.type == "cpu":
            slots = slots.to("cpu", torch.int64)
            self.cache.check_slots(slots if kept_pos is None else slots[kept_pos], token_ids)
            if not self.backend.has_streams:
                idx = torch.empty((rows, plan.total), dtype=torch.int64)
                self._fill_indices(idx, slots)
                return idx, lambda: None
            with self._ring_lock:
                slot = self._pinned_slot(rows * plan.total)
                idx = slot[0][: rows * plan.total].view(rows, plan.total)
                self._fill_indices(idx, slots)
                on_dev = idx.to(self.device, non_blocking=True)
                slot[1] = self.backend.event_after(self.backend.current_stream(self.device))
            return on_dev, lambda: None
        slots = slots.to(self.device, torch.int64)
        on_dev = kept_pos.to(self.device) if isinstance(kept_pos, torch.Tensor) else kept_pos
        kept = slots if on_dev is None else slots[on_dev]
        if self._pinned_lo_hi is None:
            self._pinned_lo_hi = self._pinned_int64(2)
        lo_hi = self._pinned_lo_hi  # read back within this call (check), so reuse is safe
        lo_hi.copy_(torch.stack(torch.aminmax(kept)), non_blocking=True)
        answered = self.backend.event_after(self.backend.current_stream(self.device))
        slots = slots.clamp(0, limit - 1)
        if rows == 1:
            idx = slots.view(1, -1)
        else:
            blocks = torch.div(slots, bs, rounding_mode="floor")
            idx = torch.stack((blocks, slots - blocks * bs))

        def check() -> None:
            self.backend.event_synchronize(answered)
            lo, hi = lo_hi.tolist()
            if lo < 0 or hi >= limit:  # find the culprits on the host (error path only)
                host = transfer.slot_mapping.to("cpu", torch.int64)[token_ids()]
                self.cache.check_slots(host, token_ids)

        return idx, check

    def _fill_indices(self, idx: torch.Tensor, slots: torch.Tensor) -> None:
        """Write ``[1, n]`` slots or ``[2, n]`` (block, offset) of host ``slots`` into ``idx``."""
        if idx.shape[0] == 1:
            idx[0] = slots
        else:
            torch.div(slots, self.block_size, rounding_mode="floor", out=idx[0])
            torch.remainder(slots, self.block_size, out=idx[1])

    pinned_ring: int = 8
    """Pinned index buffers kept for reuse (CUDA)."""

    def _pinned_slot(self, numel: int) -> list[Any]:
        """A ``[pinned int64 buffer of at least numel, None]`` ring slot whose last upload has
        finished; the caller records its new upload's event in slot ``[1]``.

        Allocating pinned memory costs ~0.2 ms a call, so buffers are reused. A buffer whose
        upload is still queued (a deferred store waits for the step's compute before its index
        upload runs) is skipped rather than waited for; only with the whole ring busy does this
        wait, for the oldest.
        """
        ring = self._pinned_idx
        for slot in ring:
            if slot[1] is None or self.backend.event_query(slot[1]):
                if slot[0].numel() < numel:
                    size = max(numel, 2 * slot[0].numel())
                    slot[0] = self._pinned_int64(size)
                slot[1] = None
                ring.remove(slot)
                ring.append(slot)  # most recently used last: the first busy one is the oldest
                return slot
        if len(ring) >= self.pinned_ring:
            slot = ring.pop(0)
            self.backend.event_synchronize(slot[1])
            if slot[0].numel() < numel:
                slot[0] = self._pinned_int64(numel)
        else:
            slot = [self._pinned_int64(max(numel, 1 << 12)), None]
        slot[1] = None
        ring.append(slot)
        return slot

    def _pinned_int64(self, numel: int) -> torch.Tensor:
        """``[numel]`` int64 of page-locked host memory (the backend's, exact size)."""
        return self.backend.pinned_empty(numel * 8).view(torch.int64)

    def _op_views(
        self, plan: _Plan, staging: torch.Tensor, layers: range, idx: torch.Tensor, op: _Op
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
        self, plan: _Plan, staging: torch.Tensor, layers: range, idx: torch.Tensor, piece: int
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
        plan: _Plan,
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
        self, plan: _Plan, staging: torch.Tensor, to_host: bool, piece: int = -1
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

    def _copy_2d(self, r: _Run, staging: torch.Tensor, to_host: bool, stream: Any) -> None:
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

    def _copy_stream(self, plan: _Plan) -> Any:
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
    ) -> _PreparedFrom | None:
        """The host side of a later all-layer :meth:`from_cache` of ``chunks`` (checked by
        the caller), done ahead: the plan, and the slot indices uploaded on ``transfer.stream``;
        ``None`` unless :meth:`plans_ahead`."""
        if not self.plans_ahead(transfer):
            return None
        layers = range(self.num_layers)
        plan = self._plan(layers, chunks, 0, self._store_pieces(transfer))
        with self._stream_ctx(transfer):
            idx, check = self._fused_indices(plan, transfer)
            uploaded = self.backend.event_after(self.backend.current_stream(self.device))
        return _PreparedFrom(layers, chunks, transfer.slot_mapping, plan, idx, check, uploaded)

    def checked_ahead(self, chunks: Sequence[ChunkTransfer], transfer: TransferSpec) -> bool:
        """A copy of the very chunk list and slot mapping that :meth:`prepare_store` planned
        (checked by its caller; a step's batched saves): no second check of every chunk."""
        prep = transfer.prepared
        return (
            isinstance(prep, _PreparedFrom)
            and prep.chunks is chunks
            and prep.slots is transfer.slot_mapping
        )

    def from_cache(
        self, layers: range, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> None:
        backend = self.backend
        deferred = transfer.deferred and transfer.stream is not None and backend.has_streams
        try:
            prep = transfer.prepared
            if not isinstance(prep, _PreparedFrom):
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
                    backend.wait_stream(main, copy)
            if not deferred:
                self._sync(transfer)
            check()
        except BaseException:
            if deferred:  # the caller releases the buffers: no queued copy may still fill them
                self._sync(transfer)
            raise

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
                runs = _Plan(plan.row_bytes, plan.layer_bytes, [])
                for piece, group in enumerate(groups):
                    pos = 0
                    for c in chunks:
                        n = c.num_tokens
                        self._add_run(
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
    ) -> bool:
        """Scatter ``layers`` from ``transfer.staged`` when it covers the chunks (waiting only
        for the copy of those layers); ``False``: not used."""
        pre = transfer.staged
        backend = self.backend
        if not isinstance(pre, Prefetched) or not backend.has_streams:
            return False
        full = range(self.num_layers)
        key = [(c.start, c.end, c.buffer.data_ptr()) for c in chunks]
        cached = pre.scatter_plan
        with self._stream_ctx(transfer):
            if cached is not None and cached[0] is transfer and cached[1] == key:
                plan, base, idx = cached[2:]  # checked when first built
            else:
                plan = self._plan(full, chunks, transfer.skip_tokens, piece_bytes=0)
                found = pre.base_for(plan)
                if found is None:
                    return False
                base = found
                idx, check = self._fused_indices(plan, transfer)
                check()
                pre.scatter_plan = (transfer, key, plan, base, idx)
            main = backend.current_stream(self.device)
            backend.wait_event(main, pre.event_for(layers.stop))
            if main != pre.stream:
                backend.record_stream(pre.staging, main)
            self._scatter(plan, pre.staging[base:], full, idx, -1, only=layers)
        return True

    def to_cache(
        self, layers: range, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> bool:
        if transfer.staged is not None and self._fused_to_staged(layers, chunks, transfer):
            return True
        plan = self._plan(layers, chunks, transfer.skip_tokens)
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
                    moved = self.to_cache(range(layer, layer + 1), chunks, transfer) or moved
                return moved
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
        self._pinned_idx = []
        self._pinned_lo_hi = None
