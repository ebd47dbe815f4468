# SPDX-License-Identifier: Apache-2.0
"""GPU connectors for vLLM 0.32/0.33 paged KV caches (``vllm.cpu`` and ``vllm.cuda``).

vLLM hands every attention layer's cache as a 4-D *logical* view ``[num_blocks, num_kv_heads,
block_size, C]`` of one shared buffer (RFC #42082); what the ``C`` axis means, and the physical
order behind the view, depend on the attention backend. Three block formats are handled, chosen
by ``layout_hints["kv_format"]`` (the adapter probes vLLM's own cache-write kernel to choose) or
by the device default:

- ``"kv_concat"`` (default on CUDA; FlashAttention and friends): ``C = head_k + head_v``, token
  ``t`` of head ``h`` holds ``K || V`` at ``[b, h, t, :]``. Any strides: physical LBHNC
  (``[blocks, heads, block_size, C]`` in memory) and LBNHC (``[blocks, block_size, heads, C]``)
  both work, because indexing goes through the strided view.
- ``"cpu_kt_v"`` (default on CPU; vLLM's CPU attention, ``vec``/``vec16`` kernels): the same
  logical shape with ``C = 2 * head_size``, but each ``(block, head)`` run of
  ``2 * block_size * head_size`` elements holds K *transposed* ``[head_size, block_size]``
  followed by V ``[block_size, head_size]``. The ``[b, h]`` run must be contiguous.
- ``"mla"``: one latent per token, ``[num_blocks, block_size, latent]`` or
  ``[num_blocks, 1, block_size, latent]``.

Every transfer moves all chunks of a request at once, through one *chunk-major* staging buffer
(on the device when ``config.gpu_staging_buffer``): chunk ``c``'s ``[num_layers, tokens, kv_width]``
block is contiguous there, so each chunk (or each run of chunks whose host buffers lie back to back
in one pool slab) moves in one copy-engine DMA. For ``kv_concat`` and ``mla`` caches whose layers
are views of one buffer with a uniform step between layers (how vLLM allocates them), all layers
are gathered/scattered through one strided ``[layers, blocks, block_size, ...]`` view with one
advanced-indexing op per run of equal-sized chunks; slot indices are built once per call, on the
host when the slot mapping is on the host (the adapter's case: no device sync at all), otherwise on
the device. Other layouts (``cpu_kt_v``, layers in separate buffers) gather layer by layer.
This module never imports vLLM.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from lmcache.gpu_connector.interface import (
    ChunkTransfer,
    EngineInfo,
    GPUConnectorInterface,
    KVLayoutError,
    SupportsLayerwise,
    TransferSpec,
)

if TYPE_CHECKING:
    from lmcache.config import LMCacheConfig
    from lmcache.metadata import LMCacheMetadata

__all__ = [
    "KV_FORMATS",
    "VLLMPagedConnector",
    "select_cpu",
    "select_cuda",
]

logger = logging.getLogger(__name__)

KV_FORMATS = ("kv_concat", "cpu_kt_v", "mla")
"""Block formats :class:`VLLMPagedConnector` understands (see the module docstring)."""


def _describe(t: torch.Tensor) -> str:
    return f"shape={tuple(t.shape)} strides={tuple(t.stride())} dtype={t.dtype} device={t.device}"


def _fuse_layers(caches: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """All layers as one strided view ``[layers, *layer_shape]``, or ``None``.

    Possible when every layer is a view of one storage with the same shape and strides and a
    uniform, non-overlapping element step between consecutive layers (vLLM's allocation).
    """
    first = caches[0]
    if first.numel() == 0:
        return None
    span = 1 + sum((n - 1) * abs(st) for n, st in zip(first.shape, first.stride(), strict=True))
    step = caches[1].storage_offset() - first.storage_offset() if len(caches) > 1 else span
    if abs(step) < span:
        return None  # layers alias or overlap: one fused write would race
    base = first.untyped_storage().data_ptr()
    for i, t in enumerate(caches):
        if (
            t.stride() != first.stride()
            or t.untyped_storage().data_ptr() != base
            or t.storage_offset() != first.storage_offset() + i * step
        ):
            return None
    try:
        return first.as_strided(
            (len(caches), *first.shape), (step, *first.stride()), first.storage_offset()
        )
    except RuntimeError:  # a view reaching outside the storage: not one buffer after all
        return None


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
    """

    lo: int
    nbytes: int
    host: torch.Tensor
    contiguous: bool
    end_ptr: int
    storage_ptr: int
    piece: int
    count: int = 1

    def host_view(self) -> torch.Tensor:
        if not self.contiguous:
            return self.host
        flat = self.host.reshape(-1).view(torch.uint8)
        if self.count == 1:
            return flat
        return flat.as_strided((self.nbytes,), (1,), flat.storage_offset())


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

    def token_ids(self) -> torch.Tensor:
        """``[total]`` int64: request token index of every staging token."""
        return torch.cat([torch.arange(a, b) for a, b in self.tokens])

    def kept_positions(self) -> torch.Tensor:
        return torch.cat([torch.arange(a, b) for a, b in self.kept])


class VLLMPagedConnector(GPUConnectorInterface, SupportsLayerwise):
    """Moves KV between vLLM's per-layer paged caches and canonical chunk buffers.

    Args:
        config: lmcache configuration (``gpu_staging_buffer`` is read).
        metadata: Geometry the caches must match.
        engine: ``EngineInfo(name="vllm", device=..., kv_caches=[per-layer tensors in layer
            order], extra={"block_size": ...})``.
        layout_hints: Optional ``{"kv_format": "kv_concat" | "cpu_kt_v" | "mla"}``.

    Raises:
        KVLayoutError: the tensors do not match the metadata or the format (message gives the
            shape and strides found and what was expected).
    """

    pipeline_bytes: int = 64 << 20
    """On CUDA, a call is cut into about four pieces of at most this many bytes (and at least
    ``min_piece_bytes``); piece ``i``'s host copy (on a side stream) overlaps piece ``i + 1``'s
    gather or piece ``i - 1``'s scatter. ``0`` runs the gather and the copies back to back on one
    stream."""

    min_piece_bytes: int = 32 << 20
    """Smallest piece: each piece costs a dozen host-side launches, which must stay well under
    its copy time (32 MiB take ~0.6 ms at PCIe 5 speed), so small calls are one piece."""

    def __init__(
        self,
        config: LMCacheConfig,
        metadata: LMCacheMetadata,
        engine: EngineInfo,
        layout_hints: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(config, metadata, engine, layout_hints)
        caches = list(engine.kv_caches)
        if not caches:
            raise KVLayoutError(
                "vLLM connector got no KV cache tensors (engine.kv_caches is empty)"
            )
        for i, t in enumerate(caches):
            if not isinstance(t, torch.Tensor):
                raise KVLayoutError(
                    f"layer {i}: expected one tensor per layer, found {type(t).__name__}"
                )
        if len(caches) != metadata.num_layers:
            raise KVLayoutError(
                f"found {len(caches)} KV cache layers, metadata expects {metadata.num_layers}"
            )
        first = caches[0]
        for i, t in enumerate(caches[1:], start=1):
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise KVLayoutError(
                    f"layer {i} ({_describe(t)}) differs from layer 0 ({_describe(first)}); "
                    "all layers must share one geometry"
                )
        if first.dtype != metadata.kv_dtype:
            raise KVLayoutError(
                f"KV dtype {first.dtype} differs from metadata.kv_dtype {metadata.kv_dtype}"
            )
        fmt = self.layout_hints.get("kv_format")
        if fmt is None:
            fmt = (
                "mla"
                if metadata.use_mla
                else ("cpu_kt_v" if first.device.type == "cpu" else "kv_concat")
            )
        if fmt not in KV_FORMATS:
            raise KVLayoutError(f"unknown kv_format {fmt!r}; expected one of {KV_FORMATS}")
        self.kv_format: str = fmt
        self._caches = [self._normalise(i, t) for i, t in enumerate(caches)]
        self.block_size: int = int(self._caches[0].shape[-2])
        hinted = engine.extra.get("block_size")
        if hinted is not None and int(hinted) != self.block_size:
            raise KVLayoutError(
                f"KV tensors have block_size {self.block_size} on axis -2 ({_describe(first)}) "
                f"but the engine reports block_size={hinted}"
            )
        self.num_blocks: int = int(self._caches[0].shape[0])
        self.device = first.device
        self._use_staging = bool(getattr(config, "gpu_staging_buffer", True))
        self._last_stream: Any = None
        # Fused all-layer view (see _setup_fused); None -> the per-layer path.
        self._fused: torch.Tensor | None = None
        self._fused_split = False  # head_k != head_v: rows are [heads, K||V], split on copy
        self._fused_by_slot = False  # _fused is [L, slots, *row], else [L, B, N, *row]
        self._layer_ids = torch.empty(0, dtype=torch.int64)
        self._all_layers = self._layer_ids
        self._copy_stream_obj: Any = None
        if self.kv_format != "cpu_kt_v" and (self.device.type == "cpu" or self._use_staging):
            self._setup_fused()

    # -- geometry -------------------------------------------------------------------------

    def _normalise(self, i: int, t: torch.Tensor) -> torch.Tensor:
        md = self.metadata
        if self.kv_format == "mla":
            if t.dim() == 4 and t.shape[1] == 1:
                t = t[:, 0]
            if t.dim() != 3 or t.shape[2] != md.head_size_k:
                raise KVLayoutError(
                    f"layer {i}: MLA cache {_describe(t)}; expected [num_blocks, block_size, "
                    f"{md.head_size_k}] or [num_blocks, 1, block_size, {md.head_size_k}]"
                )
            return t
        expected_c = md.head_size_k + md.head_size_v
        if t.dim() != 4 or t.shape[1] != md.num_kv_heads or t.shape[3] != expected_c:
            raise KVLayoutError(
                f"layer {i}: KV cache {_describe(t)}; expected [num_blocks, {md.num_kv_heads} "
                f"kv heads, block_size, {expected_c} = head_k {md.head_size_k} + head_v "
                f"{md.head_size_v}] (vLLM 0.32/0.33 per-layer view)"
            )
        if self.kv_format == "cpu_kt_v":
            if md.head_size_k != md.head_size_v:
                raise KVLayoutError(
                    f"layer {i}: cpu_kt_v needs head_k == head_v, found {md.head_size_k} and "
                    f"{md.head_size_v}"
                )
            n, c = t.shape[2], t.shape[3]
            if t.stride(3) != 1 or t.stride(2) != c:
                raise KVLayoutError(
                    f"layer {i}: vLLM CPU cache {_describe(t)}; each [block, head] run of "
                    f"{n}x{c} elements must be contiguous (strides [..., {c}, 1]); a CPU cache "
                    "is physically LBHNC"
                )
        return t

    def _setup_fused(self) -> None:
        """Build ``self._fused``: every layer at once, indexed ``[layer, block, offset]``.

        ``mla``: ``[L, B, N, latent]``. ``kv_concat``: ``[L, B, N, 2, H, head]`` when K and V
        heads are equal (so one gathered row is already the canonical ``[all K, all V]``),
        else ``[L, B, N, H, head_k + head_v]``. Rows are widened to 16-byte elements when the
        strides allow (same bytes, fewer elements for the index kernels), and ``B, N`` merge
        into one slot axis when their strides allow (FlashAttention's LBNHC, MLA).
        """
        fused = _fuse_layers(self._caches)
        if fused is None:
            logger.info(
                "lmcache: vLLM KV layers are not views of one buffer with a uniform step "
                "(layer 0: %s); gathering layer by layer",
                _describe(self._caches[0]),
            )
            return
        md = self.metadata
        if self.kv_format == "mla":
            view = fused  # [L, B, N, D]
        else:
            view = fused.permute(0, 1, 3, 2, 4)  # [L, B, N, H, C]
            if md.head_size_k == md.head_size_v:
                view = view.unflatten(-1, (2, md.head_size_k)).transpose(3, 4)
            else:
                self._fused_split = True
        if not self._fused_split:
            view = _widen(view, self.kv_width * fused.element_size())
        try:  # [L, slots, *row]: one index per token instead of (block, offset)
            view = view.view(view.shape[0], -1, *view.shape[3:])
            self._fused_by_slot = True
        except RuntimeError:  # blocks and offsets do not merge (e.g. LBHNC)
            pass
        self._fused = view
        self._layer_ids = torch.arange(self.num_layers, dtype=torch.int64, device=self.device)
        self._all_layers = self._layer_ids.view(1, -1, 1)

    @property
    def num_layers(self) -> int:
        return len(self._caches)

    @property
    def kv_width(self) -> int:
        return self.metadata.kv_width

    @property
    def dtype(self) -> torch.dtype:
        return self._caches[0].dtype

    # -- per-layer gather / scatter ----------------------------------------------------------

    def _gather_layer(self, layer: int, blocks: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """KV of tokens at ``(blocks, offs)`` of one layer as ``[num_tokens, kv_width]``."""
        t = self._caches[layer]
        n = blocks.numel()
        if self.kv_format == "mla":
            return t[blocks, offs]
        md = self.metadata
        if self.kv_format == "kv_concat":
            x = t[blocks, :, offs, :]  # [n, heads, hk + hv]
            k = x[:, :, : md.head_size_k].reshape(n, -1)
            v = x[:, :, md.head_size_k :].reshape(n, -1)
            return torch.cat((k, v), dim=1)
        hs, bs = md.head_size_k, t.shape[2]
        flat = t.flatten(2)  # [B, H, 2 * bs * hs]
        kt = flat[:, :, : hs * bs].unflatten(2, (hs, bs))  # [B, H, hs, bs]
        vv = flat[:, :, hs * bs :].unflatten(2, (bs, hs))  # [B, H, bs, hs]
        k = kt[blocks, :, :, offs]  # [n, H, hs]
        v = vv[blocks, :, offs, :]  # [n, H, hs]
        return torch.cat((k.reshape(n, -1), v.reshape(n, -1)), dim=1)

    def _scatter_layer(
        self, layer: int, blocks: torch.Tensor, offs: torch.Tensor, src: torch.Tensor
    ) -> None:
        """Write ``src`` ``[num_tokens, kv_width]`` into one layer's slots."""
        t = self._caches[layer]
        n = blocks.numel()
        if self.kv_format == "mla":
            t[blocks, offs] = src
            return
        md = self.metadata
        heads = md.num_kv_heads
        k = src[:, : heads * md.head_size_k].reshape(n, heads, md.head_size_k)
        v = src[:, heads * md.head_size_k :].reshape(n, heads, md.head_size_v)
        if self.kv_format == "kv_concat":
            t[blocks, :, offs, :] = torch.cat((k, v), dim=2)
            return
        hs, bs = md.head_size_k, t.shape[2]
        flat = t.flatten(2)
        kt = flat[:, :, : hs * bs].unflatten(2, (hs, bs))
        vv = flat[:, :, hs * bs :].unflatten(2, (bs, hs))
        kt[blocks, :, :, offs] = k
        vv[blocks, :, offs, :] = v

    # -- request-level bookkeeping -------------------------------------------------------------

    def _check_chunks(self, chunks: Sequence[ChunkTransfer], transfer: TransferSpec) -> None:
        for c in chunks:
            want = self.chunk_shape(c.num_tokens)
            if tuple(c.buffer.shape) != want:
                raise ValueError(
                    f"chunk [{c.start}, {c.end}) buffer has shape {tuple(c.buffer.shape)}; "
                    f"expected {want} ([num_layers, num_tokens, kv_width])"
                )
            if c.buffer.dtype != self.dtype:
                raise ValueError(
                    f"chunk [{c.start}, {c.end}) buffer has dtype {c.buffer.dtype}; expected "
                    f"{self.dtype} (the KV cache dtype)"
                )
            if c.start < 0 or c.end > transfer.slot_mapping.numel() or c.end <= c.start:
                raise ValueError(
                    f"chunk [{c.start}, {c.end}) is outside the slot mapping of "
                    f"{transfer.slot_mapping.numel()} tokens"
                )

    def _token_slots(
        self, chunks: Sequence[ChunkTransfer], transfer: TransferSpec, skip: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(positions in the staging tensor, block ids, block offsets)`` of moved tokens."""
        idx = torch.cat([torch.arange(c.start, c.end) for c in chunks])
        pos = torch.arange(idx.numel())
        if skip > 0:
            keep = idx >= skip
            idx, pos = idx[keep], pos[keep]
        slots = transfer.slot_mapping.to("cpu", torch.int64)[idx]
        self._check_slots(slots, lambda: idx)
        blocks = torch.div(slots, self.block_size, rounding_mode="floor")
        offs = slots - blocks * self.block_size
        return pos.to(self.device), blocks.to(self.device), offs.to(self.device)

    def _check_slots(self, slots: torch.Tensor, token_ids: Any) -> None:
        """Raise ``ValueError`` unless every entry of ``slots`` (host, int64) is a valid slot;
        ``token_ids()`` gives the request token index of each entry (for the message)."""
        if slots.numel() == 0:
            return
        lo, hi = (int(x) for x in torch.aminmax(slots))
        if lo < 0:
            bad = token_ids()[slots < 0][:8].tolist()
            raise ValueError(
                f"slot mapping has -1 for tokens {bad} that a chunk transfers; every "
                "transferred token needs a slot"
            )
        if hi >= self.num_blocks * self.block_size:
            raise ValueError(
                f"slot {hi} is beyond the cache ({self.num_blocks} blocks x "
                f"{self.block_size} tokens)"
            )

    def _stream_ctx(self, transfer: TransferSpec) -> Any:
        """Run on ``transfer.stream``, ordered after the work already queued on the current
        stream (the engine's writes of the KV being saved, or its reads of the pages)."""
        if self.device.type == "cuda" and transfer.stream is not None:
            transfer.stream.wait_stream(torch.cuda.current_stream(self.device))
            return torch.cuda.stream(transfer.stream)
        return contextlib.nullcontext()

    def _staging(self, layers: int, num_tokens: int) -> torch.Tensor:
        where = self.device if self._use_staging else torch.device("cpu")
        return torch.empty((layers, num_tokens, self.kv_width), dtype=self.dtype, device=where)

    def _sync(self, transfer: TransferSpec) -> None:
        if self.device.type == "cuda":
            stream = transfer.stream or torch.cuda.current_stream(self.device)
            stream.synchronize()

    # -- GPUConnectorInterface ----------------------------------------------------------------

    def from_gpu(self, chunks: Sequence[ChunkTransfer], transfer: TransferSpec) -> None:
        self._from(range(self.num_layers), chunks, transfer)

    def to_gpu(self, chunks: Sequence[ChunkTransfer], transfer: TransferSpec) -> None:
        self._to(range(self.num_layers), chunks, transfer)

    def from_gpu_layer(
        self, layer: int, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> None:
        self._from(range(layer, layer + 1), chunks, transfer)

    def to_gpu_layer(
        self, layer: int, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> None:
        self._to(range(layer, layer + 1), chunks, transfer)

    def _from(self, layers: range, chunks: Sequence[ChunkTransfer], transfer: TransferSpec) -> None:
        if not chunks:
            return
        self._check_chunks(chunks, transfer)
        if self._fused is not None:
            self._fused_from(layers, chunks, transfer)
            return
        pos, blocks, offs = self._token_slots(chunks, transfer, 0)
        with self._stream_ctx(transfer):
            staging = self._staging(len(layers), pos.numel())
            for i, layer in enumerate(layers):
                staging[i].copy_(self._gather_layer(layer, blocks, offs), non_blocking=True)
            start = 0
            for c in chunks:
                n = c.num_tokens
                dst = c.buffer[layers.start : layers.stop]
                dst.copy_(staging[:, start : start + n], non_blocking=True)
                start += n
        self._sync(transfer)

    def _to(self, layers: range, chunks: Sequence[ChunkTransfer], transfer: TransferSpec) -> None:
        if not chunks:
            return
        self._check_chunks(chunks, transfer)
        if self._fused is not None:
            self._fused_to(layers, chunks, transfer)
            return
        pos, blocks, offs = self._token_slots(chunks, transfer, transfer.skip_tokens)
        if pos.numel() == 0:
            return
        with self._stream_ctx(transfer):
            staging = self._staging(len(layers), sum(c.num_tokens for c in chunks))
            start = 0
            for c in chunks:
                n = c.num_tokens
                staging[:, start : start + n].copy_(
                    c.buffer[layers.start : layers.stop], non_blocking=True
                )
                start += n
            staging = staging.to(self.device, non_blocking=True)
            for i, layer in enumerate(layers):
                self._scatter_layer(layer, blocks, offs, staging[i].index_select(0, pos))
        self._last_stream = transfer.stream

    # -- fused path: all layers per op, chunk-major staging ------------------------------------

    def _piece_bytes(self, total_bytes: int) -> int:
        """Target bytes per piece on CUDA (0: one piece): about four pieces a call, each at
        most ``pipeline_bytes`` and at least ``min_piece_bytes`` (capped by the former)."""
        cap = self.pipeline_bytes
        if self.device.type != "cuda" or cap <= 0:
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
            and last.piece == piece
            and last.end_ptr == ptr
            and last.storage_ptr == sptr
            and last.lo + last.nbytes == lo
        ):
            last.nbytes += nbytes
            last.end_ptr += nbytes
            last.count += 1
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
            self._check_slots(slots if kept_pos is None else slots[kept_pos], token_ids)
            pin = self.device.type == "cuda"
            idx = torch.empty((rows, plan.total), dtype=torch.int64, pin_memory=pin)
            if rows == 1:
                idx[0] = slots
            else:
                torch.div(slots, bs, rounding_mode="floor", out=idx[0])
                torch.remainder(slots, bs, out=idx[1])
            return idx.to(self.device, non_blocking=True), lambda: None
        slots = slots.to(self.device, torch.int64)
        on_dev = kept_pos.to(self.device) if isinstance(kept_pos, torch.Tensor) else kept_pos
        kept = slots if on_dev is None else slots[on_dev]
        lo_hi = torch.empty(2, dtype=torch.int64, pin_memory=True)
        lo_hi.copy_(torch.stack(torch.aminmax(kept)), non_blocking=True)
        answered = torch.cuda.Event()
        answered.record()
        slots = slots.clamp(0, limit - 1)
        if rows == 1:
            idx = slots.view(1, -1)
        else:
            blocks = torch.div(slots, bs, rounding_mode="floor")
            idx = torch.stack((blocks, slots - blocks * bs))

        def check() -> None:
            answered.synchronize()
            lo, hi = lo_hi.tolist()
            if lo < 0 or hi >= limit:  # find the culprits on the host (error path only)
                host = transfer.slot_mapping.to("cpu", torch.int64)[token_ids()]
                self._check_slots(host, token_ids)

        return idx, check

    def _op_views(
        self, plan: _Plan, staging: torch.Tensor, layers: range, idx: torch.Tensor, op: _Op
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """``(index tensors, staging view [g, layers, n - t0, *row])`` of one op."""
        assert self._fused is not None
        nl = op.l1 - op.l0
        if nl == self.num_layers:
            lids = self._all_layers
        else:
            a = layers.start + op.l0
            lids = self._layer_ids[a : a + nl].view(1, -1, 1)
        tok = idx[:, op.pos : op.pos + op.g * op.n]
        if op.t0:
            tok = tok.view(-1, op.g, op.n)[:, :, op.t0 :]
        tok = tok.view(-1, op.g, 1, op.n - op.t0)
        lo = op.pos * plan.row_bytes + op.l0 * op.n * plan.layer_bytes
        region = staging[lo : lo + op.g * op.n * nl * plan.layer_bytes]
        if self._fused_split:
            view = region.view(self.dtype).view(op.g, nl, op.n, self.kv_width)
        else:
            a = self._fused
            row = a.shape[2:] if self._fused_by_slot else a.shape[3:]
            view = region.view(a.dtype).view(op.g, nl, op.n, *row)
        if op.t0:
            view = view[:, :, op.t0 :]
        return [lids, *tok.unbind(0)], view

    def _split_kv(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[..., kv_width]`` -> K ``[..., H, head_k]`` and V ``[..., H, head_v]`` views."""
        md = self.metadata
        nk = md.num_kv_heads * md.head_size_k
        k = rows[..., :nk].unflatten(-1, (md.num_kv_heads, md.head_size_k))
        v = rows[..., nk:].unflatten(-1, (md.num_kv_heads, md.head_size_v))
        return k, v

    def _gather(
        self, plan: _Plan, staging: torch.Tensor, layers: range, idx: torch.Tensor, piece: int
    ) -> None:
        """Gather every op of ``piece`` (all ops when ``piece < 0``) into staging."""
        assert self._fused is not None
        for op in plan.ops:
            if piece >= 0 and op.piece != piece:
                continue
            index, out = self._op_views(plan, staging, layers, idx, op)
            if self._fused_split:
                rows = self._fused[tuple(index)]  # [g, layers, n, H, head_k + head_v]
                k, v = self._split_kv(out)
                k.copy_(rows[..., : self.metadata.head_size_k])
                v.copy_(rows[..., self.metadata.head_size_k :])
            else:
                torch.ops.aten.index.Tensor_out(self._fused, index, out=out)

    def _scatter(
        self, plan: _Plan, staging: torch.Tensor, layers: range, idx: torch.Tensor, piece: int
    ) -> None:
        """Scatter every op of ``piece`` (all ops when ``piece < 0``) into the cache."""
        assert self._fused is not None
        for op in plan.ops:
            if piece >= 0 and op.piece != piece:
                continue
            index, src = self._op_views(plan, staging, layers, idx, op)
            if self._fused_split:
                src = torch.cat(self._split_kv(src), dim=-1)
            self._fused.index_put_(tuple(index), src)

    def _copy_runs(
        self, plan: _Plan, staging: torch.Tensor, to_host: bool, piece: int = -1
    ) -> None:
        for r in plan.runs:
            if piece >= 0 and r.piece != piece:
                continue
            dev = staging[r.lo : r.lo + r.nbytes]
            host = r.host_view()
            if not r.contiguous:
                dev = dev.view(self.dtype).view(host.shape)
            if to_host:
                host.copy_(dev, non_blocking=True)
            else:
                dev.copy_(host, non_blocking=True)

    def _copy_stream(self, plan: _Plan) -> Any:
        """The side stream for the host copies when ``plan`` has several pieces, else ``None``."""
        if plan.pieces <= 1:
            return None
        if self._copy_stream_obj is None:
            self._copy_stream_obj = torch.cuda.Stream(self.device)
        return self._copy_stream_obj

    def _fused_from(
        self, layers: range, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> None:
        plan = self._plan(layers, chunks, 0)
        with self._stream_ctx(transfer):
            idx, check = self._fused_indices(plan, transfer)
            staging = torch.empty(
                plan.total * plan.row_bytes, dtype=torch.uint8, device=self.device
            )
            copy = self._copy_stream(plan)
            if copy is None:
                self._gather(plan, staging, layers, idx, -1)
                self._copy_runs(plan, staging, to_host=True)
            else:  # gather piece i + 1 while piece i goes to the host
                main = torch.cuda.current_stream(self.device)
                for piece in range(plan.pieces):
                    self._gather(plan, staging, layers, idx, piece)
                    copy.wait_stream(main)
                    with torch.cuda.stream(copy):
                        self._copy_runs(plan, staging, to_host=True, piece=piece)
                main.wait_stream(copy)
        self._sync(transfer)
        check()

    def _fused_to(
        self, layers: range, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> None:
        plan = self._plan(layers, chunks, transfer.skip_tokens)
        if plan.total == 0:
            return
        with self._stream_ctx(transfer):
            idx, check = self._fused_indices(plan, transfer)
            staging = torch.empty(
                plan.total * plan.row_bytes, dtype=torch.uint8, device=self.device
            )
            copy = self._copy_stream(plan)
            if copy is None:
                self._copy_runs(plan, staging, to_host=False)
                check()
                self._scatter(plan, staging, layers, idx, -1)
            else:  # scatter piece i while piece i + 1 comes from the host
                main = torch.cuda.current_stream(self.device)
                copy.wait_stream(main)  # staging's memory may have been in use on main
                done = []
                with torch.cuda.stream(copy):
                    for piece in range(plan.pieces):
                        self._copy_runs(plan, staging, to_host=False, piece=piece)
                        done.append(copy.record_event())
                check()
                for piece in range(plan.pieces):
                    main.wait_event(done[piece])
                    self._scatter(plan, staging, layers, idx, piece)
        self._last_stream = transfer.stream

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            stream = self._last_stream or torch.cuda.current_stream(self.device)
            stream.synchronize()

    def close(self) -> None:
        self._caches = []
        self._fused = None


def _is_vllm(engine: EngineInfo) -> bool:
    return engine.name == "vllm"


def select_cpu(
    config: LMCacheConfig,
    metadata: LMCacheMetadata,
    engine: EngineInfo,
    layout_hints: Mapping[str, Any] | None = None,
) -> type[GPUConnectorInterface] | None:
    """Selector for ``vllm.cpu`` (entry point ``lmcache.gpu_connectors``)."""
    if not _is_vllm(engine) or engine.device != "cpu":
        return None
    return VLLMPagedConnector


def select_cuda(
    config: LMCacheConfig,
    metadata: LMCacheMetadata,
    engine: EngineInfo,
    layout_hints: Mapping[str, Any] | None = None,
) -> type[GPUConnectorInterface] | None:
    """Selector for ``vllm.cuda`` (entry point ``lmcache.gpu_connectors``)."""
    if not _is_vllm(engine) or engine.device != "cuda":
        return None
    return VLLMPagedConnector
