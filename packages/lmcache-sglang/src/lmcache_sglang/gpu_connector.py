# SPDX-License-Identifier: Apache-2.0
"""GPU connectors for SGLang KV pools (``sglang.cpu`` and ``sglang.cuda``).

SGLang keeps one K and one V tensor per attention layer, indexed by *slot* (a token's place in the
pool, ``slot = page_id * page_size + offset``):

- MHA (``MHATokenToKVPool``): ``k_buffer[layer]`` ``[slots, kv_heads, head_dim]`` and
  ``v_buffer[layer]`` ``[slots, kv_heads, v_head_dim]``. ``EngineInfo.kv_caches[layer]`` is the
  tuple ``(k, v)``.
- MLA (``MLATokenToKVPool``): ``kv_buffer[layer]`` ``[slots, 1, latent]`` (``kv_lora_rank +
  qk_rope_head_dim``). ``kv_caches[layer]`` is that tensor (or a 1-tuple of it).

``layout_hints["kv_layout"]`` selects how a tensor is addressed by slot:

- ``"token"`` (default): ``[slots, heads, dim]`` as above; any strides (a host pool's
  ``page_first`` per-layer view is a strided ``[slots, heads, dim]``).
- ``"paged_nhd"``: ``[pages, page_size, heads, dim]`` (HiCache's ``page_first_direct`` host
  layout).
- ``"paged_hnd"``: ``[pages, heads, page_size, dim]`` (the paged HND layout of SGLang's
  page-head pools).

Paged layouts need ``layout_hints["page_size"]`` (or ``engine.extra["page_size"]``) to match the
tensor. Bytes move through the canonical chunk format of :mod:`lmcache.gpu_connector.interface`:
``[num_layers, tokens, H * head_k + H * head_v]`` (all K heads, then all V heads), MLA
``[num_layers, tokens, latent]``. The connector is layerwise (:class:`SupportsLayerwise`).

On CUDA the transfers go through the ``lmcache.gpu_ops`` kernels
(:mod:`lmcache_sglang.kernel_transfer`): a store returns each chunk's checksum, computed on the
device, and a load writes only the chunks whose bytes match the checksum stored with them
(:attr:`SGLangKVConnector.verifies_checksums`). Elsewhere (CPU, XPU) the transfers are torch
indexing and the cache engine checksums the chunks on the host. On the CPU, when every layer is
a view of one buffer (a HiCache host pool, :func:`~lmcache_sglang.kv_pools.token_rows`) and each
chunk's slots are one run (a page), each chunk moves with one strided copy of all its layers,
straight between the pool and its buffer; chunks in consecutive slots whose buffers lie back to
back move with one copy together, and in any other order with one indexed copy per allocation
(:mod:`lmcache_sglang.host_pool_batches`).

This module never imports SGLang.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from lmcache.devices import DeviceBackend, get_backend
from lmcache.gpu_connector.checksums import LoadChecks, StoreChecksums, staged_tokens
from lmcache.gpu_connector.interface import ChunkTransfer, EngineInfo, KVLayoutError, TransferSpec
from lmcache.gpu_connector.layer_range import LayerRangeConnector, engine_selector, moved_tokens
from lmcache_sglang.host_pool_batches import page_batches
from lmcache_sglang.kernel_transfer import KernelTransfer, paged_kv
from lmcache_sglang.kv_pools import Spans, TokenRows, back_to_back, slot_spans, token_rows

if TYPE_CHECKING:
    from lmcache.config import LMCacheConfig
    from lmcache.metadata import LMCacheMetadata

__all__ = ["KV_LAYOUTS", "SGLangKVConnector", "select_cpu", "select_cuda"]

KV_LAYOUTS = ("token", "paged_nhd", "paged_hnd")
"""Values of ``layout_hints["kv_layout"]``."""


def _describe(t: torch.Tensor) -> str:
    return f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')} strides {list(t.stride())}"


class SGLangKVConnector(LayerRangeConnector):
    """Moves KV between SGLang's per-layer K/V (or MLA latent) pools and chunk buffers.

    Args:
        config: lmcache configuration.
        metadata: Geometry the pools must match (heads, head sizes, dtype, layers, MLA).
        engine: ``EngineInfo(name="sglang", device=..., kv_caches=[(k, v) per layer] or
            [latent per layer])``.
        layout_hints: Optional ``{"kv_layout": "token" | "paged_nhd" | "paged_hnd",
            "page_size": int}``.

    Raises:
        KVLayoutError: a tensor does not match the metadata or the layout; the message gives
            the shape, dtype and strides found and the shape expected.
    """

    def __init__(
        self,
        config: LMCacheConfig,
        metadata: LMCacheMetadata,
        engine: EngineInfo,
        layout_hints: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(config, metadata, engine, layout_hints)
        layout = str(self.layout_hints.get("kv_layout", "token"))
        if layout not in KV_LAYOUTS:
            raise KVLayoutError(
                f"SGLang connector: unknown kv_layout {layout!r}; expected one of {KV_LAYOUTS}"
            )
        self.kv_layout = layout
        page_size = self.layout_hints.get("page_size", engine.extra.get("page_size"))
        self.page_size: int = int(page_size) if page_size is not None else 1
        if layout != "token" and page_size is None:
            raise KVLayoutError(
                f"SGLang connector: kv_layout {layout!r} needs layout_hints['page_size']"
            )
        caches = list(engine.kv_caches)
        if len(caches) != metadata.num_layers:
            raise KVLayoutError(
                f"SGLang connector: found {len(caches)} KV layers, metadata expects "
                f"{metadata.num_layers}"
            )
        self._layers: list[tuple[torch.Tensor, ...]] = [
            self._check_layer(i, entry) for i, entry in enumerate(caches)
        ]
        first = self._layers[0][0]
        self.device: torch.device = first.device
        self.backend: DeviceBackend = get_backend(self.device)  # streams, events, syncs
        self.num_slots: int = self._slots_of(first)
        for i, parts in enumerate(self._layers):
            for t in parts:
                if t.device != self.device or self._slots_of(t) != self.num_slots:
                    raise KVLayoutError(
                        f"SGLang connector: layer {i} tensor {_describe(t)} on {t.device} "
                        f"differs from layer 0 ({_describe(first)} on {self.device}); every "
                        "layer must hold the same slots on one device"
                    )
        self.kernels: KernelTransfer | None = None
        """The kernel path with device checksums (CUDA), else ``None`` (torch indexing)."""
        if self.device.type == "cuda" and self.backend.has_streams:
            self.kernels = self.kernel_transfer()
        self.rows: TokenRows | None = None
        """Every layer as one strided view (host pools whose layers share a buffer): chunks
        whose slots are one run move with one copy each (:meth:`_runs`). Only for memory the
        backend reaches without streams: a device's copies must run on the transfer's stream."""
        if self.kernels is None and self.device.type == "cpu" and not self.backend.has_streams:
            self.rows = token_rows(self._layers, layout, self.page_size)

    def kernel_transfer(self) -> KernelTransfer | None:
        """The kernel path over this connector's pools, or ``None`` when the kernels cannot
        address them (e.g. layers with different strides). The constructor attaches it on CUDA,
        where the ops run as the compiled kernels, their Triton port or vectorized torch
        (:func:`lmcache.gpu_ops.implementation`); on other devices they run as vectorized
        torch (tests attach it there)."""
        paged = paged_kv(self._layers, self.kv_layout)
        return KernelTransfer(paged, self.backend) if paged is not None else None

    @property
    def verifies_checksums(self) -> bool:
        """Whether stores return chunk checksums computed on the device and loads verify them
        there before writing the pools (the kernel path)."""
        return self.kernels is not None

    # -- geometry ---------------------------------------------------------------------------

    def _expected(self, heads: int, dim: int) -> str:
        if self.kv_layout == "token":
            return f"[slots, {heads}, {dim}]"
        if self.kv_layout == "paged_nhd":
            return f"[pages, {self.page_size}, {heads}, {dim}]"
        return f"[pages, {heads}, {self.page_size}, {dim}]"

    def _check_tensor(self, i: int, what: str, t: Any, heads: int, dim: int) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise KVLayoutError(
                f"SGLang connector: layer {i} {what}: expected a tensor, found {type(t).__name__}"
            )
        expected = self._expected(heads, dim)
        if self.kv_layout == "token":
            ok = t.dim() == 3 and t.shape[1] == heads and t.shape[2] == dim
        elif self.kv_layout == "paged_nhd":
            ok = t.dim() == 4 and tuple(t.shape[1:]) == (self.page_size, heads, dim)
        else:
            ok = t.dim() == 4 and tuple(t.shape[1:]) == (heads, self.page_size, dim)
        if not ok:
            raise KVLayoutError(
                f"SGLang connector: layer {i} {what} is {_describe(t)}; expected {expected} "
                f"(kv_layout={self.kv_layout!r})"
            )
        if t.dtype != self.metadata.kv_dtype:
            raise KVLayoutError(
                f"SGLang connector: layer {i} {what} dtype {t.dtype} differs from "
                f"metadata.kv_dtype {self.metadata.kv_dtype}"
            )
        return t

    def _check_layer(self, i: int, entry: Any) -> tuple[torch.Tensor, ...]:
        md = self.metadata
        parts = tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)
        if md.use_mla:
            if len(parts) != 1:
                raise KVLayoutError(
                    f"SGLang connector: layer {i}: an MLA layer is one latent tensor, found "
                    f"{len(parts)} tensors"
                )
            return (self._check_tensor(i, "latent", parts[0], 1, md.head_size_k),)
        if len(parts) != 2:
            raise KVLayoutError(
                f"SGLang connector: layer {i}: an MHA layer is a (k, v) tuple, found "
                f"{len(parts)} tensor(s)"
            )
        k = self._check_tensor(i, "K", parts[0], md.num_kv_heads, md.head_size_k)
        v = self._check_tensor(i, "V", parts[1], md.num_kv_heads, md.head_size_v)
        return (k, v)

    def _slots_of(self, t: torch.Tensor) -> int:
        if self.kv_layout == "token":
            return int(t.shape[0])
        return int(t.shape[0]) * self.page_size

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    @property
    def dtype(self) -> torch.dtype:
        return self.metadata.kv_dtype

    # -- slot addressing --------------------------------------------------------------------

    def _index(self, slots: torch.Tensor) -> tuple[Any, ...]:
        """Index tuple selecting ``slots`` of a tensor as ``[n, heads, dim]``."""
        if self.kv_layout == "token":
            return (slots,)
        pages = torch.div(slots, self.page_size, rounding_mode="floor")
        offs = slots - pages * self.page_size
        if self.kv_layout == "paged_nhd":
            return (pages, offs)
        return (pages, slice(None), offs)  # advanced indices around a slice: [n, heads, dim]

    def _gather(self, layer: int, index: tuple[Any, ...], n: int) -> torch.Tensor:
        """``[n, kv_width]`` rows of ``layer`` at ``index``."""
        return torch.cat([t[index].reshape(n, -1) for t in self._layers[layer]], dim=1)

    def _token_shape(self, t: torch.Tensor) -> tuple[int, int]:
        """``(heads, dim)`` of one token of ``t``."""
        if self.kv_layout == "paged_hnd":
            return int(t.shape[1]), int(t.shape[3])
        return int(t.shape[-2]), int(t.shape[-1])

    def _scatter(self, layer: int, index: tuple[Any, ...], rows: torch.Tensor) -> None:
        """Write ``rows`` ``[n, kv_width]`` into ``layer`` at ``index``."""
        n, start = rows.shape[0], 0
        for t in self._layers[layer]:
            heads, dim = self._token_shape(t)
            t[index] = rows[:, start : start + heads * dim].reshape(n, heads, dim)
            start += heads * dim

    def _slots(
        self, chunks: Sequence[ChunkTransfer], transfer: TransferSpec, skip: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows in the concatenated chunks, device slots)`` of the tokens moved."""
        idx, rows, slots = moved_tokens(chunks, transfer, skip)
        self._check_slots(idx, slots)
        return rows, slots.to(self.device)

    def _staged_slots(
        self, chunks: Sequence[ChunkTransfer], transfer: TransferSpec, skip: int
    ) -> tuple[list[int], torch.Tensor]:
        """``(positions, host slots)`` of the kernel path: the chunks with a token from ``skip``
        on, and the slot of each of their tokens, ``-1`` for those before ``skip`` (checked)."""
        positions, _, tokens, slots = staged_tokens(chunks, transfer.slot_mapping, skip)
        moved = tokens >= skip
        self._check_slots(torch.from_numpy(tokens[moved]), torch.from_numpy(slots[moved]))
        return positions, torch.from_numpy(slots)

    def _check_slots(self, idx: torch.Tensor, slots: torch.Tensor) -> None:
        """Refuse slots of moved tokens (request indices ``idx``) outside the pool."""
        if slots.numel():
            lo, hi = (int(x) for x in torch.aminmax(slots))
            if lo < 0:
                bad = idx[slots < 0][:8].tolist()
                raise ValueError(
                    f"SGLang connector: slot mapping has negative slots for tokens {bad} that a "
                    "chunk transfers; expected a slot for every transferred token"
                )
            if hi >= self.num_slots:
                raise ValueError(
                    f"SGLang connector: slot {hi} is beyond the pool's {self.num_slots} slots; "
                    "pass slots of this pool"
                )

    def _spans(
        self, chunks: Sequence[ChunkTransfer], transfer: TransferSpec, skip: int
    ) -> Spans | None:
        """Each chunk's run of pool slots from ``skip`` on (:func:`slot_spans`), when the pool is
        one strided view (a HiCache host pool); else ``None`` (the indexed path)."""
        rows = self.rows
        if rows is None:
            return None
        width = rows.shape[0] * rows.shape[1] * rows.shape[2]
        return slot_spans(chunks, transfer.slot_mapping, skip, self.num_slots, width)

    def _runs(self, layers: range, spans: Spans) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """``(pool view, buffer view)`` pairs, ``[runs, len(layers), n, parts, heads, dim]``
        each, covering the ``spans`` (:meth:`_spans`); ``None`` when a run cannot be one view
        (the indexed path, which also reports bad slots). Whole chunks of one size whose slots
        follow each other and whose buffers lie back to back in one allocation (what
        ``allocate_many`` hands out) share one pair: one copy moves them all."""
        rows = self.rows
        if rows is None:
            return None
        shape = rows.shape
        width = shape[0] * shape[1] * shape[2]
        out = []
        i = 0
        while i < len(spans):
            c, a, first, n = spans[i]
            group = back_to_back(spans, i, self.num_layers)
            pool = rows.run(layers, first, n, group) if group > 1 else None
            if pool is not None:
                buf = c.buffer.as_strided(
                    pool.shape,
                    (c.buffer.numel(), n * width, width, shape[1] * shape[2], shape[2], 1),
                    c.buffer.storage_offset() + layers.start * n * width,
                )
                out.append((pool, buf))
                i += group
                continue
            pool = rows.run(layers, first, n)
            if pool is None:
                return None
            buf = c.buffer[layers.start : layers.stop, a - c.start : c.end - c.start]
            out.append((pool, buf.view(*buf.shape[:2], *shape).unsqueeze(0)))
            i += 1
        return out

    # -- transfers: LayerRangeConnector runs from_gpu, to_gpu and the layerwise methods --------

    def _from(
        self, layers: range, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> StoreChecksums | None:
        if self.kernels is not None:
            return self._from_kernels(self.kernels, layers, chunks, transfer)
        spans = self._spans(chunks, transfer, 0)
        batches = page_batches(self.rows, layers, spans, self.num_slots)
        if batches is not None:  # pages in any order: one call per back-to-back run of buffers
            batches.store()
            return None
        runs = self._runs(layers, spans) if spans is not None else None
        if runs is not None:  # one copy per run of chunks, all their layers
            for pool, buf in runs:
                buf.copy_(pool)
            return None
        _, slots = self._slots(chunks, transfer, 0)
        index = self._index(slots)
        n = slots.numel()
        with self._stream_ctx(transfer):
            staging = torch.stack([self._gather(layer, index, n) for layer in layers])
            host = staging.to("cpu") if staging.device.type != "cpu" else staging
            start = 0
            for c in chunks:
                c.buffer[layers.start : layers.stop].copy_(host[:, start : start + c.num_tokens])
                start += c.num_tokens
        return None

    def _to(
        self, layers: range, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> LoadChecks | None:
        if self.kernels is not None:
            return self._to_kernels(self.kernels, layers, chunks, transfer)
        spans = self._spans(chunks, transfer, transfer.skip_tokens)
        batches = page_batches(self.rows, layers, spans, self.num_slots)
        if batches is not None:  # pages in any order: one call per back-to-back run of buffers
            batches.load()
            self._last_stream = transfer.stream
            return None
        runs = self._runs(layers, spans) if spans is not None else None
        if runs is not None:  # one copy per run of chunks, all their layers
            for pool, buf in runs:
                pool.copy_(buf)
            self._last_stream = transfer.stream
            return None
        rows, slots = self._slots(chunks, transfer, transfer.skip_tokens)
        if slots.numel() == 0:
            return None
        index = self._index(slots)
        host = torch.cat([c.buffer[layers.start : layers.stop] for c in chunks], dim=1)[:, rows]
        with self._stream_ctx(transfer):
            staging = host.to(self.device, non_blocking=True)
            for i, layer in enumerate(layers):
                self._scatter(layer, index, staging[i])
        self._last_stream = transfer.stream
        return None

    def _from_kernels(
        self,
        kernels: KernelTransfer,
        layers: range,
        chunks: Sequence[ChunkTransfer],
        transfer: TransferSpec,
    ) -> StoreChecksums | None:
        """:meth:`_from` through the gather kernel, which also sums each chunk's bytes of the
        layers moved (:meth:`KernelTransfer.store`). Returns when the host buffers hold the bytes, or, ``transfer.deferred`` with a stream, once
        the copies are enqueued on it."""
        positions, slots = self._staged_slots(chunks, transfer, 0)
        backend = self.backend
        stream = transfer.stream
        if stream is None:
            stream = backend.current_stream(self.device)
        deferred = transfer.deferred and transfer.stream is not None
        try:
            with self._stream_ctx(transfer):
                index = kernels.index(chunks, positions, slots)
                sums = kernels.store(layers, chunks, index, transfer.on_engine_read)
        except BaseException:
            if deferred and backend.has_streams:  # the caller releases the buffers at once
                backend.stream_synchronize(stream)
            raise
        if not deferred and backend.has_streams:
            backend.stream_synchronize(stream)
        return sums

    def _to_kernels(
        self,
        kernels: KernelTransfer,
        layers: range,
        chunks: Sequence[ChunkTransfer],
        transfer: TransferSpec,
    ) -> LoadChecks | None:
        """:meth:`_to` through the scatter kernel, verifying the chunks that carry a
        checksum (:meth:`KernelTransfer.load`); enqueued, :meth:`synchronize` waits."""
        positions, slots = self._staged_slots(chunks, transfer, transfer.skip_tokens)
        if not positions:
            return None
        with self._stream_ctx(transfer):
            index = kernels.index(chunks, positions, slots)
            checks = kernels.load(layers, chunks, index)
        self._last_stream = transfer.stream
        return checks

    def close(self) -> None:
        self._layers = []
        if self.kernels is not None:
            self.kernels.checks.close()  # no queued upload may read a freed buffer
        self.kernels = None


select_cpu = engine_selector("sglang", "cpu", SGLangKVConnector)
select_cuda = engine_selector("sglang", "cuda", SGLangKVConnector)
