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

This module never imports SGLang.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from lmcache.devices import DeviceBackend, get_backend
from lmcache.gpu_connector.interface import ChunkTransfer, EngineInfo, KVLayoutError, TransferSpec
from lmcache.gpu_connector.layer_range import LayerRangeConnector, engine_selector, moved_tokens

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
        return rows, slots.to(self.device)

    # -- transfers: LayerRangeConnector runs from_gpu, to_gpu and the layerwise methods --------

    def _from(self, layers: range, chunks: Sequence[ChunkTransfer], transfer: TransferSpec) -> None:
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

    def _to(self, layers: range, chunks: Sequence[ChunkTransfer], transfer: TransferSpec) -> None:
        rows, slots = self._slots(chunks, transfer, transfer.skip_tokens)
        if slots.numel() == 0:
            return
        index = self._index(slots)
        host = torch.cat([c.buffer[layers.start : layers.stop] for c in chunks], dim=1)[:, rows]
        with self._stream_ctx(transfer):
            staging = host.to(self.device, non_blocking=True)
            for i, layer in enumerate(layers):
                self._scatter(layer, index, staging[i])
        self._last_stream = transfer.stream

    def close(self) -> None:
        self._layers = []


select_cpu = engine_selector("sglang", "cpu", SGLangKVConnector)
select_cuda = engine_selector("sglang", "cuda", SGLangKVConnector)
