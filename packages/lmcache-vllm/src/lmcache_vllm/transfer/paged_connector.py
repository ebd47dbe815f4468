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
  (:func:`lmcache_vllm.transfer.kv_formats.amx_views`); moved token by token through a staging
  buffer.
- ``"mla"``: one latent per token, ``[num_blocks, block_size, latent]`` or
  ``[num_blocks, 1, block_size, latent]``.

The connector checks the tensors against the metadata once.
It describes them as a :class:`~lmcache_vllm.transfer.paged_cache.PagedKVCache`.
It resolves the device backend (:func:`lmcache.devices.get_backend`), through which every
stream, event, pinned buffer and host copy goes.
From these it chooses a *transfer strategy*, held as :attr:`transfer`.
Every transfer goes to the strategy (``_from``/``_to`` of :class:`LayerRangeConnector`,
``prepare_store``, ``prefetch``).
The strategy gets what it needs as constructor arguments and reads nothing of the connector:

- ``cpu_kt_v`` on a CPU engine: :class:`~lmcache_vllm.transfer.cpu_block_transfer.CpuBlockTransfer`,
  block by block straight between the cache and the chunk buffers (no staging), all layers per
  op when they share a buffer.
- ``kv_concat`` and ``mla`` (CPU, or a device with ``config.gpu_staging_buffer``) whose layers
  are views of one buffer with a uniform step (how vLLM allocates them), or share strides:
  :class:`~lmcache_vllm.transfer.fused.transfer.FusedTransfer`, one strided all-layer view (or one
  view per layer), chunk-major staging, merged copy-engine DMAs, device copies ahead of a load.
- anything else (layers that differ in strides, ``cpu_amx``, ``cpu_kt_v`` on a GPU, no device
  staging): :class:`~lmcache_vllm.transfer.token_transfer.TokenTransfer`, layer by layer, token by
  token (:mod:`lmcache_vllm.transfer.kv_formats`), through a staging buffer.

This module never imports vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from lmcache.devices import DeviceBackend, get_backend
from lmcache.gpu_connector.interface import ChunkTransfer, EngineInfo, KVLayoutError, TransferSpec
from lmcache.gpu_connector.layer_range import LayerRangeConnector
from lmcache_vllm.transfer.cpu_block_transfer import CpuBlockTransfer
from lmcache_vllm.transfer.fused.transfer import FusedTransfer, Prefetched
from lmcache_vllm.transfer.kv_formats import KV_FORMATS, describe
from lmcache_vllm.transfer.paged_cache import PagedKVCache, PagedTransfer
from lmcache_vllm.transfer.token_transfer import TokenTransfer

if TYPE_CHECKING:
    from lmcache.config import LMCacheConfig
    from lmcache.metadata import LMCacheMetadata

__all__ = ["VLLMPagedConnector"]

logger = logging.getLogger(__name__)


class VLLMPagedConnector(LayerRangeConnector):
    """Moves KV between vLLM's per-layer paged caches and canonical chunk buffers, through the
    transfer strategy it chose at construction (:attr:`transfer`; see the module docstring).

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
        normalised = tuple(self._normalise(i, t) for i, t in enumerate(caches))
        self.block_size: int = int(normalised[0].shape[-2])
        hinted = engine.extra.get("block_size")
        if hinted is not None and int(hinted) != self.block_size:
            raise KVLayoutError(
                f"KV tensors have block_size {self.block_size} on axis -2 ({describe(first)}) "
                f"but the engine reports block_size={hinted}"
            )
        self.num_blocks: int = int(normalised[0].shape[0])
        self.device = first.device
        self.cache = PagedKVCache(
            caches=normalised,
            kv_format=fmt,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            num_kv_heads=metadata.num_kv_heads,
            head_size_k=metadata.head_size_k,
            head_size_v=metadata.head_size_v,
            kv_width=metadata.kv_width,
        )
        # The one place the device is resolved: every stream, event, pinned buffer and host
        # copy of this connector goes through this backend.
        self.backend: DeviceBackend = get_backend(self.device)
        use_staging = bool(getattr(config, "gpu_staging_buffer", True))
        # stores sum on the device unless the configuration turned checksums off
        checksums = config.checksum_for(self.device.type, on_device=True)
        self.transfer: PagedTransfer = self._choose_transfer(use_staging, checksums)

    def _choose_transfer(self, use_staging: bool, checksums: bool) -> PagedTransfer:
        """The transfer strategy of this cache (see the module docstring)."""
        cache, on_cpu = self.cache, self.device.type == "cpu"
        if cache.kv_format == "cpu_kt_v" and on_cpu:
            return CpuBlockTransfer(cache)  # the block path, no staging
        if cache.kv_format in ("kv_concat", "mla") and (on_cpu or use_staging):
            fused = FusedTransfer.for_cache(cache, self.backend, checksums)
            if fused is not None:
                return fused
        staging = self.device if use_staging else torch.device("cpu")
        return TokenTransfer(cache, self.backend, staging)

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
        return self.cache.num_layers

    @property
    def dtype(self) -> torch.dtype:
        return self.cache.dtype

    # -- transfers: LayerRangeConnector runs from_gpu, to_gpu and the layerwise methods --------
    # (to_gpu_layers: one _to over the range, one strided op and merged DMAs on the fused path)

    @property
    def verifies_checksums(self) -> bool:
        """Whether the strategy sums chunks on the device and verifies loads there (the fused
        path on a device with streams)."""
        fused = self.transfer
        return isinstance(fused, FusedTransfer) and fused.verifies_checksums

    def _from(self, layers: range, chunks: Sequence[ChunkTransfer], transfer: TransferSpec) -> Any:
        return self.transfer.from_cache(layers, chunks, transfer)

    def _to(self, layers: range, chunks: Sequence[ChunkTransfer], transfer: TransferSpec) -> Any:
        moved = self.transfer.to_cache(layers, chunks, transfer)
        if moved is not False:
            self._last_stream = transfer.stream
        return moved

    def _checked_ahead(self, chunks: Sequence[ChunkTransfer], transfer: TransferSpec) -> bool:
        fused = self.transfer
        return isinstance(fused, FusedTransfer) and fused.checked_ahead(chunks, transfer)

    def prepare_store(self, chunks: Sequence[ChunkTransfer], transfer: TransferSpec) -> Any:
        """On the fused CUDA path, plan a later :meth:`from_gpu` of ``chunks`` now (before the
        step has written their KV): the staging layout, the host copies and the slot indices
        (uploaded on ``transfer.stream``, which the copy must use too). Else ``None``."""
        fused = self.transfer
        if not isinstance(fused, FusedTransfer) or not chunks or not fused.plans_ahead(transfer):
            return None
        self.check_chunks(chunks, transfer)
        return fused.prepare_store(chunks, transfer)

    def prefetch(
        self, chunks: Sequence[ChunkTransfer], stream: Any, groups: Sequence[range] = ()
    ) -> Prefetched | None:
        """Copy whole chunks (all layers) to a device staging buffer now, on ``stream``, for a
        later load (``TransferSpec.staged``); ``None`` unless the fused path on CUDA. See
        :meth:`FusedTransfer.prefetch
        <lmcache_vllm.transfer.fused.transfer.FusedTransfer.prefetch>`."""
        fused = self.transfer
        if not isinstance(fused, FusedTransfer):
            return None
        return fused.prefetch(chunks, stream, groups)

    def verify_chunks(
        self, chunks: Sequence[ChunkTransfer], stream: Any, prefetched: Prefetched | None = None
    ) -> list[bool] | None:
        """Whether each chunk's host bytes match its ``checksum``, checked on the device now
        (waits); ``None`` unless :attr:`verifies_checksums`. See :meth:`FusedTransfer.
        verify_chunks <lmcache_vllm.transfer.fused.transfer.FusedTransfer.verify_chunks>`."""
        fused = self.transfer
        if not isinstance(fused, FusedTransfer):
            return None
        return fused.verify_chunks(chunks, stream, prefetched)

    def close(self) -> None:
        self.transfer.close()
