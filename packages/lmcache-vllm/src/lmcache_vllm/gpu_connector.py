# SPDX-License-Identifier: Apache-2.0
"""GPU connectors for vLLM 0.26-0.33 paged KV caches (``vllm.cpu`` and ``vllm.cuda``).

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
- ``"cpu_amx"`` (vLLM's CPU attention ``amx`` kernels: bf16 on CPUs with AMX, block size a
  multiple of 32): per ``(block, head)`` K then V as above, each VNNI-packed in pairs
  (:func:`lmcache_vllm.kv_formats.amx_views`); moved token by token through a staging buffer.
- ``"mla"``: one latent per token, ``[num_blocks, block_size, latent]`` or
  ``[num_blocks, 1, block_size, latent]``.

Which path moves the bytes:

- ``cpu_kt_v`` on a CPU engine: :mod:`lmcache_vllm.cpu_block_transfer`, block by block straight
  between the cache and the chunk buffers (no staging), all layers per op when they share a buffer.
- ``kv_concat`` and ``mla`` whose layers are views of one buffer with a uniform step (how vLLM
  allocates them): :mod:`lmcache_vllm.fused_transfer`, one strided all-layer view, chunk-major
  staging, merged copy-engine DMAs.
- anything else (layers in separate buffers, ``cpu_kt_v`` on a GPU): layer by layer, token by
  token (:mod:`lmcache_vllm.kv_formats`), through a staging buffer.

This module never imports vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from lmcache.devices import DeviceBackend, get_backend
from lmcache.gpu_connector.interface import ChunkTransfer, EngineInfo, KVLayoutError, TransferSpec
from lmcache.gpu_connector.layer_range import LayerRangeConnector, engine_selector, moved_tokens
from lmcache_vllm.cpu_block_transfer import KtVBlockTransfer
from lmcache_vllm.fused_transfer import FusedTransfer
from lmcache_vllm.kv_formats import KV_FORMATS, describe, gather_layer, scatter_layer

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


class VLLMPagedConnector(FusedTransfer, KtVBlockTransfer, LayerRangeConnector):
    """Moves KV between vLLM's per-layer paged caches and canonical chunk buffers.

    Args:
        config: lmcache configuration (``gpu_staging_buffer`` is read).
        metadata: Geometry the caches must match.
        engine: ``EngineInfo(name="vllm", device=..., kv_caches=[per-layer tensors in layer
            order], extra={"block_size": ...})``.
        layout_hints: Optional ``{"kv_format": "kv_concat" | "cpu_kt_v" | "cpu_amx" | "mla"}``.

    Raises:
        KVLayoutError: the tensors do not match the metadata or the format (message gives the
            shape and strides found and what was expected).
    """

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
                    f"layer {i} ({describe(t)}) differs from layer 0 ({describe(first)}); "
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
                f"KV tensors have block_size {self.block_size} on axis -2 ({describe(first)}) "
                f"but the engine reports block_size={hinted}"
            )
        self.num_blocks: int = int(self._caches[0].shape[0])
        self.device = first.device
        # The one place the device is resolved: every stream, event, pinned buffer and host
        # copy of this connector goes through this backend.
        self.backend: DeviceBackend = get_backend(self.device)
        self._use_staging = bool(getattr(config, "gpu_staging_buffer", True))
        self._init_fused()
        # cpu_kt_v on a CPU engine: the block path (cpu_block_transfer), no staging.
        self._kt_v_blocks = self.kv_format == "cpu_kt_v" and self.device.type == "cpu"
        if self._kt_v_blocks:
            self._setup_kt_v_blocks()
        elif self.kv_format in ("kv_concat", "mla") and (
            self.device.type == "cpu" or self._use_staging
        ):
            self._setup_fused()

    # -- geometry -------------------------------------------------------------------------

    def _normalise(self, i: int, t: torch.Tensor) -> torch.Tensor:
        md = self.metadata
        if self.kv_format == "mla":
            if t.dim() == 4 and t.shape[1] == 1:
                t = t[:, 0]
            if t.dim() != 3 or t.shape[2] != md.head_size_k:
                raise KVLayoutError(
                    f"layer {i}: MLA cache {describe(t)}; expected [num_blocks, block_size, "
                    f"{md.head_size_k}] or [num_blocks, 1, block_size, {md.head_size_k}]"
                )
            return t
        expected_c = md.head_size_k + md.head_size_v
        if t.dim() != 4 or t.shape[1] != md.num_kv_heads or t.shape[3] != expected_c:
            raise KVLayoutError(
                f"layer {i}: KV cache {describe(t)}; expected [num_blocks, {md.num_kv_heads} "
                f"kv heads, block_size, {expected_c} = head_k {md.head_size_k} + head_v "
                f"{md.head_size_v}] (vLLM 0.26-0.33 per-layer view)"
            )
        if self.kv_format in ("cpu_kt_v", "cpu_amx"):
            if md.head_size_k != md.head_size_v:
                raise KVLayoutError(
                    f"layer {i}: {self.kv_format} needs head_k == head_v, found "
                    f"{md.head_size_k} and {md.head_size_v}"
                )
            if self.kv_format == "cpu_amx" and (t.shape[2] % 32 or md.head_size_k % 32):
                raise KVLayoutError(
                    f"layer {i}: cpu_amx needs block_size and head size multiples of 32, found "
                    f"{t.shape[2]} and {md.head_size_k}"
                )
            n, c = t.shape[2], t.shape[3]
            if t.stride(3) != 1 or t.stride(2) != c:
                raise KVLayoutError(
                    f"layer {i}: vLLM CPU cache {describe(t)}; each [block, head] run of "
                    f"{n}x{c} elements must be contiguous (strides [..., {c}, 1]); a CPU cache "
                    "is physically LBHNC"
                )
        return t

    @property
    def num_layers(self) -> int:
        return len(self._caches)

    @property
    def dtype(self) -> torch.dtype:
        return self._caches[0].dtype

    # -- per-layer gather / scatter (token level) ----------------------------------------------

    def _gather_layer(self, layer: int, blocks: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """KV of tokens at ``(blocks, offs)`` of one layer as ``[num_tokens, kv_width]``."""
        return gather_layer(
            self.kv_format, self._caches[layer], self.metadata.head_size_k, blocks, offs
        )

    def _scatter_layer(
        self, layer: int, blocks: torch.Tensor, offs: torch.Tensor, src: torch.Tensor
    ) -> None:
        """Write ``src`` ``[num_tokens, kv_width]`` into one layer's slots."""
        md = self.metadata
        scatter_layer(
            self.kv_format,
            self._caches[layer],
            md.num_kv_heads,
            md.head_size_k,
            md.head_size_v,
            blocks,
            offs,
            src,
        )

    # -- request-level bookkeeping -------------------------------------------------------------

    def _token_slots(
        self, chunks: Sequence[ChunkTransfer], transfer: TransferSpec, skip: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(positions in the staging tensor, block ids, block offsets)`` of moved tokens."""
        idx, pos, slots = moved_tokens(chunks, transfer, skip)
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

    def _staging(self, layers: int, num_tokens: int) -> torch.Tensor:
        where = self.device if self._use_staging else torch.device("cpu")
        return torch.empty((layers, num_tokens, self.kv_width), dtype=self.dtype, device=where)

    def _sync(self, transfer: TransferSpec) -> None:
        """Wait for the transfer's stream, asleep (a blocking-sync event): the caller may be
        a save thread waiting through a whole forward, which must not spin a core that the
        engine's own thread could be sharing."""
        backend = self.backend
        if backend.has_streams:
            stream = transfer.stream or backend.current_stream(self.device)
            backend.event_synchronize(backend.event_after(stream, blocking=True))

    # -- transfers: LayerRangeConnector runs from_gpu, to_gpu and the layerwise methods --------
    # (to_gpu_layers: one _to over the range, one strided op and merged DMAs on the fused path)

    def _from(self, layers: range, chunks: Sequence[ChunkTransfer], transfer: TransferSpec) -> None:
        if self._kt_v_blocks:
            self._kt_v_from(layers, chunks, transfer)
            return
        if self._fused_any:
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

    def prepare_store(self, chunks: Sequence[ChunkTransfer], transfer: TransferSpec) -> Any:
        """On the fused CUDA path, plan a later :meth:`from_gpu` of ``chunks`` now (before the
        step has written their KV): the staging layout, the host copies and the slot indices
        (uploaded on ``transfer.stream``, which the copy must use too). Else ``None``."""
        if self._kt_v_blocks or not self._fused_any or not chunks:
            return None
        return self._fused_prepare(chunks, transfer)

    def _to(self, layers: range, chunks: Sequence[ChunkTransfer], transfer: TransferSpec) -> None:
        if self._kt_v_blocks:
            self._kt_v_to(layers, chunks, transfer)
            return
        if self._fused_any:
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

    def close(self) -> None:
        self._caches = []
        self._fused = None
        self._fused_layers = None
        self._kt_v_sources = []
        self._pinned_idx = []
        self._pinned_lo_hi = None


select_cpu = engine_selector("vllm", "cpu", VLLMPagedConnector)
select_cuda = engine_selector("vllm", "cuda", VLLMPagedConnector)
