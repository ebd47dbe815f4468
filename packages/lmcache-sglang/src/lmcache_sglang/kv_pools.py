# SPDX-License-Identifier: Apache-2.0
"""What SGLang's KV pools look like, read from their real tensors.

:func:`device_pool_layers` reads a device pool (``MHATokenToKVPool``: ``k_buffer`` /
``v_buffer``, NHD ``[slots, heads, dim]`` or HND ``[pages, heads, page_size, dim]`` per layer;
``MLATokenToKVPool``: ``kv_buffer`` ``[slots, 1, latent]``), :func:`host_pool_layers` a HiCache
host pool (``kv_buffer`` in the ``layer_first``, ``page_first`` or ``page_first_direct`` layout),
and :func:`build_metadata` turns the geometry and the model facts into
:class:`~lmcache.metadata.LMCacheMetadata`. :func:`token_rows` describes every layer of a pool
whose layers are views of one buffer (a HiCache host pool) as one strided tensor, so that a run
of slots moves with one copy. Nothing here imports SGLang: the pools are read by attribute.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from lmcache.gpu_connector.interface import ChunkTransfer, EngineInfo, KVLayoutError
from lmcache.metadata import LMCacheMetadata
from lmcache_sglang.sglang_types import HostKVPool

__all__ = [
    "HOST_LAYOUTS",
    "PoolLayers",
    "Spans",
    "TokenRows",
    "back_to_back",
    "build_metadata",
    "device_pool_layers",
    "host_pool_layers",
    "host_layer_views",
    "slot_spans",
    "token_rows",
]

Spans = list[tuple[ChunkTransfer, int, int, int]]
"""``(chunk, first token moved, first slot, tokens moved)`` per chunk (:func:`slot_spans`)."""

HOST_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
"""HiCache host layouts lmcache reads and writes."""


@dataclass(frozen=True)
class PoolLayers:
    """A pool's per-layer tensors and geometry.

    Attributes:
        kv_caches: Per layer ``(k, v)`` (MHA) or ``latent`` (MLA), as the connector takes them.
        layout_hints: Connector layout hints (``kv_layout``, ``page_size``).
        use_mla: One latent per token.
        num_kv_heads: Heads per layer (1 for MLA).
        head_size_k: Elements per K head (the latent size for MLA).
        head_size_v: Elements per V head (0 for MLA).
        dtype: Element dtype of the tensors.
        device: Where the tensors are.
    """

    kv_caches: list[Any]
    layout_hints: dict[str, Any]
    use_mla: bool
    num_kv_heads: int
    head_size_k: int
    head_size_v: int
    dtype: torch.dtype
    device: torch.device
    extra: dict[str, Any] = field(default_factory=dict)

    def engine_info(self, page_size: int) -> EngineInfo:
        """``EngineInfo(name="sglang", device=...)`` over these tensors."""
        return EngineInfo(
            name="sglang",
            device=self.device.type,
            kv_caches=self.kv_caches,
            extra={"page_size": page_size, **self.extra},
        )


def _pool_error(pool: object, what: str) -> KVLayoutError:
    return KVLayoutError(
        f"lmcache-sglang cannot read the KV pool {type(pool).__name__}: {what}. Supported: "
        "MHATokenToKVPool (NHD or HND) and MLATokenToKVPool; other pools (SWA, Mamba, "
        "DeepSeek V4, vectorized_5d) are not cached by lmcache."
    )


def device_pool_layers(kvcache: object, page_size: int) -> PoolLayers:
    """The per-layer tensors of SGLang's device KV pool.

    Raises:
        KVLayoutError: a pool or layout lmcache does not handle.
    """
    kv_buffer = getattr(kvcache, "kv_buffer", None)
    k_buffer = getattr(kvcache, "k_buffer", None)
    v_buffer = getattr(kvcache, "v_buffer", None)
    if isinstance(kv_buffer, (list, tuple)) and kv_buffer and k_buffer is None:
        first = kv_buffer[0]
        if not isinstance(first, torch.Tensor) or first.dim() != 3 or first.shape[1] != 1:
            raise _pool_error(kvcache, f"MLA kv_buffer[0] is {getattr(first, 'shape', first)}")
        return PoolLayers(
            kv_caches=list(kv_buffer),
            layout_hints={"kv_layout": "token"},
            use_mla=True,
            num_kv_heads=1,
            head_size_k=int(first.shape[2]),
            head_size_v=0,
            dtype=first.dtype,
            device=first.device,
        )
    if not (isinstance(k_buffer, (list, tuple)) and isinstance(v_buffer, (list, tuple))):
        raise _pool_error(kvcache, "it has neither k_buffer/v_buffer lists nor an MLA kv_buffer")
    if not k_buffer or len(k_buffer) != len(v_buffer):
        raise _pool_error(kvcache, f"{len(k_buffer)} K layers but {len(v_buffer)} V layers")
    layout = str(getattr(kvcache, "kv_cache_layout", "nhd") or "nhd")
    k0, v0 = k_buffer[0], v_buffer[0]
    if layout == "nhd" and k0.dim() == 3:
        hints: dict[str, Any] = {"kv_layout": "token"}
        heads, hk, hv = int(k0.shape[1]), int(k0.shape[2]), int(v0.shape[2])
    elif layout == "hnd" and k0.dim() == 4:
        hints = {"kv_layout": "paged_hnd", "page_size": page_size}
        heads, hk, hv = int(k0.shape[1]), int(k0.shape[3]), int(v0.shape[3])
    else:
        raise _pool_error(kvcache, f"kv_cache_layout={layout!r} with K of shape {list(k0.shape)}")
    return PoolLayers(
        kv_caches=list(zip(k_buffer, v_buffer, strict=True)),
        layout_hints=hints,
        use_mla=False,
        num_kv_heads=heads,
        head_size_k=hk,
        head_size_v=hv,
        dtype=k0.dtype,
        device=k0.device,
    )


def host_layer_views(
    kv_buffer: torch.Tensor, layout: str, num_layers: int, use_mla: bool
) -> tuple[list[Any], str]:
    """Per-layer views of a HiCache host ``kv_buffer`` and the connector ``kv_layout``.

    MHA ``kv_buffer``: ``layer_first`` ``[2, layers, slots, H, D]``, ``page_first`` ``[2, slots,
    layers, H, D]``, ``page_first_direct`` ``[2, pages, layers, page_size, H, D]``. MLA: the same
    without the leading ``2``. Also works on one flat page reshaped to those dims.

    Raises:
        KVLayoutError: another layout.
    """
    if layout not in HOST_LAYOUTS:
        raise KVLayoutError(
            f"lmcache-sglang HiCache backend: host layout {layout!r} is not supported; "
            f"expected one of {HOST_LAYOUTS} (--hicache-mem-layout)"
        )
    parts = [kv_buffer] if use_mla else [kv_buffer[0], kv_buffer[1]]
    if layout == "layer_first":
        views = [[p[i] for p in parts] for i in range(num_layers)]
        kv_layout = "token"
    else:  # page_first: [slots, layers, ...]; page_first_direct: [pages, layers, ps, ...]
        views = [[p[:, i] for p in parts] for i in range(num_layers)]
        kv_layout = "token" if layout == "page_first" else "paged_nhd"
    caches: list[Any] = [v[0] if use_mla else (v[0], v[1]) for v in views]
    return caches, kv_layout


def host_pool_layers(host_pool: HostKVPool) -> PoolLayers:
    """The per-layer tensors of a HiCache host pool (``MHATokenToKVPoolHost`` /
    ``MLATokenToKVPoolHost``).

    Raises:
        KVLayoutError: an unsupported pool or layout.
    """
    kv_buffer = getattr(host_pool, "kv_buffer", None)
    layout = str(getattr(host_pool, "layout", ""))
    if not isinstance(kv_buffer, torch.Tensor):
        raise _pool_error(host_pool, "it has no kv_buffer tensor")
    # MHA host pools have head_num on every SGLang, MLA ones none (0.5.17 MHA has no v_head_dim)
    use_mla = "MLA" in type(host_pool).__name__ or not hasattr(host_pool, "head_num")
    num_layers = int(host_pool.layer_num)
    caches, kv_layout = host_layer_views(kv_buffer, layout, num_layers, use_mla)
    page_size = int(host_pool.page_size)
    first = caches[0] if use_mla else caches[0][0]
    heads, dim = (int(first.shape[-2]), int(first.shape[-1]))
    return PoolLayers(
        kv_caches=caches,
        layout_hints={"kv_layout": kv_layout, "page_size": page_size},
        use_mla=use_mla,
        num_kv_heads=1 if use_mla else heads,
        head_size_k=dim,
        head_size_v=0 if use_mla else int(caches[0][1].shape[-1]),
        dtype=kv_buffer.dtype,
        device=kv_buffer.device,
    )


def build_metadata(
    layers: PoolLayers,
    *,
    model_name: str,
    page_size: int,
    world_size: int,
    rank: int,
    model_revision: str = "",
    quantization: str = "",
    kv_cache_dtype: str = "",
    model_digest: str = "",
) -> LMCacheMetadata:
    """Metadata of a pool whose chunks hold ``page_size`` tokens (an SGLang page for the page
    hooks; lmcache's ``chunk_size`` for ``--enable-lmcache``).

    MLA caches are the same on every tensor-parallel rank, so MLA metadata records rank 0 of 1
    (ranks share the pages); MHA records this rank, so ranks never read each other's heads.
    """
    if layers.use_mla:
        world_size, rank = 1, 0
    return LMCacheMetadata(
        model_name=model_name,
        world_size=world_size,
        worker_id=rank,
        local_worker_id=0,
        local_world_size=1,
        kv_dtype=layers.dtype,
        num_layers=len(layers.kv_caches),
        num_kv_heads=layers.num_kv_heads,
        head_size_k=layers.head_size_k,
        head_size_v=layers.head_size_v,
        use_mla=layers.use_mla,
        chunk_size=page_size,
        model_revision=model_revision,
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
        model_digest=model_digest,
    )


@dataclass(frozen=True)
class TokenRows:
    """Every layer of a pool as one strided view of the buffer its layers share.

    Token ``t`` (at offset ``o`` of page ``p``: ``t = p * page_size + o``), layer ``l``, part
    ``k`` (K, V; the latent for MLA), head ``h``, element ``d`` is at storage offset ``base + l *
    layer + k * part + p * page + o * token + h * head + d * elem`` of ``anchor``'s storage.

    Attributes:
        anchor: A tensor on that storage (layer 0's first part).
        shape: ``(parts, heads, dim)`` of one token of one layer.
        strides: ``(layer, part, page, token, head, elem)`` in elements.
        base: Storage offset of layer 0, part 0, slot 0.
        page_size: Tokens per page (1 for a ``token`` layout: then ``page == token``).
    """

    anchor: torch.Tensor
    shape: tuple[int, int, int]
    strides: tuple[int, int, int, int, int, int]
    base: int
    page_size: int

    def run(self, layers: range, slot: int, count: int, runs: int = 1) -> torch.Tensor | None:
        """``[runs, len(layers), count, parts, heads, dim]``, a view of the pool: run ``i`` is
        layers ``layers`` of slots ``slot + i * count .. slot + (i + 1) * count - 1``; ``None``
        when those slots are not evenly spaced (a run crossing pages that do not follow each
        other, or runs that are not whole pages of such pages)."""
        layer, part, page, token, head, elem = self.strides
        first_page, offset = divmod(slot, self.page_size)
        if page == token * self.page_size:  # pages follow each other (always for ``token``)
            step = count * token
        elif offset + count > self.page_size:
            return None
        elif runs == 1:
            step = 0
        elif offset == 0 and count == self.page_size:  # whole pages, one per run
            step = page
        else:
            return None
        return self.anchor.as_strided(
            (runs, len(layers), count, *self.shape),
            (step, layer, token, part, head, elem),
            self.base + layers.start * layer + first_page * page + offset * token,
        )


def token_rows(
    layers: list[tuple[torch.Tensor, ...]], kv_layout: str, page_size: int
) -> TokenRows | None:
    """A :class:`TokenRows` of per-layer ``(k, v)`` (or ``(latent,)``) tensors in ``kv_layout``
    (``token``, ``paged_nhd``, ``paged_hnd``), or ``None`` when they are not views of one buffer
    at evenly spaced offsets with one shape and strides (e.g. a device pool allocated layer by
    layer, or K and V of different head sizes)."""
    first = layers[0][0]
    shape = tuple(int(d) for d in first.shape)
    stride = tuple(int(d) for d in first.stride())
    storage = first.untyped_storage().data_ptr()
    for parts in layers:
        for t in parts:
            same = tuple(t.shape) == shape and tuple(t.stride()) == stride
            if not same or t.untyped_storage().data_ptr() != storage or t.dtype != first.dtype:
                return None
    base = int(first.storage_offset())
    layer = int(layers[1][0].storage_offset()) - base if len(layers) > 1 else 0
    part = int(layers[0][1].storage_offset()) - base if len(layers[0]) > 1 else 0
    if (len(layers) > 1 and layer <= 0) or (len(layers[0]) > 1 and part <= 0):
        return None
    for i, parts in enumerate(layers):
        for k, t in enumerate(parts):
            if t.storage_offset() != base + i * layer + k * part:
                return None
    if kv_layout == "token":  # [slots, heads, dim]
        _, heads, dim = shape
        page, token, head, elem = stride[0], stride[0], stride[1], stride[2]
        page_size = 1
    elif kv_layout == "paged_nhd":  # [pages, page_size, heads, dim]
        _, _, heads, dim = shape
        page, token, head, elem = stride
    else:  # paged_hnd: [pages, heads, page_size, dim]
        _, heads, _, dim = shape
        page, head, token, elem = stride
    return TokenRows(
        first, (len(layers[0]), heads, dim), (layer, part, page, token, head, elem), base, page_size
    )


def back_to_back(spans: Spans, i: int, num_layers: int) -> int:
    """How many ``(chunk, first token, first slot, tokens)`` spans from ``i`` on are whole
    contiguous ``[num_layers, n, width]`` buffers of one size, back to back in one allocation,
    whose slots follow each other (one strided copy moves them all)."""
    c0, a0, first, n = spans[i]
    buf = c0.buffer
    if a0 != c0.start or not buf.is_contiguous() or buf.shape[0] != num_layers:
        return 1
    storage, offset, size = buf.untyped_storage().data_ptr(), buf.storage_offset(), buf.numel()
    k = 1
    while i + k < len(spans):
        c, a, slot, m = spans[i + k]
        b = c.buffer
        if m != n or a != c.start or slot != first + k * n or not b.is_contiguous():
            break
        if b.storage_offset() != offset + k * size or b.untyped_storage().data_ptr() != storage:
            break
        k += 1
    return k


def slot_spans(
    chunks: Sequence[ChunkTransfer], mapping: torch.Tensor, skip: int, num_slots: int, width: int
) -> Spans | None:
    """``(chunk, first token, first slot, tokens)`` of every chunk's tokens from ``skip`` on,
    when each chunk's sit in one run of consecutive slots of a pool of ``num_slots`` (HiCache's
    pages) and its buffer rows are ``width`` wide; else ``None``. ``mapping`` is the transfer's
    slot mapping (a CPU vector; anything else is ``None`` too)."""
    if not chunks or mapping.device.type != "cpu" or mapping.dim() != 1:
        return None
    end = max(c.end for c in chunks)
    if end > mapping.numel():
        return None
    slots = mapping[:end].to(torch.int64).numpy()
    # breaks[i]: how many times the slots stop being consecutive before token i
    breaks = np.concatenate(([0], np.cumsum(np.diff(slots) != 1)))
    spans = []
    for c in chunks:
        a = max(c.start, skip)
        n = c.end - a
        if n <= 0:
            continue
        first = int(slots[a])
        if breaks[c.end - 1] != breaks[a] or first < 0 or first + n > num_slots:
            return None
        if c.buffer.shape[-1] != width:
            return None
        spans.append((c, a, first, n))
    return spans
