# SPDX-License-Identifier: Apache-2.0
"""The device path of :class:`~lmcache_sglang.gpu_connector.SGLangKVConnector`: the
``lmcache.gpu_ops`` kernels, with chunk checksums computed and verified on the device.

SGLang's per-layer pools are a :class:`lmcache.gpu_ops.PagedKV` once viewed as ``[pages,
page_size, heads, dim]``: a token pool ``[slots, heads, dim]`` is page size 1, a paged HND pool
``[pages, heads, page_size, dim]`` is transposed, and an MLA latent is K with no V. The kernels'
chunk-major staging lays chunk ``c`` out as ``[layers, n_c, heads * head_k + heads * head_v]``
(all K heads, then all V heads; MLA: the latent). That is the connector's host chunk buffer
``[num_layers, tokens, kv_width]`` byte for byte, so each chunk moves between staging and its
buffer in one copy, and a sum of staging bytes is :func:`lmcache.gpu_ops.chunk_checksum` of the
host chunk.

- **Store.** One ``gather_kv`` launch copies every chunk into staging and sums each chunk in the
  same pass. The chunks go to their host buffers, the sums to a host tensor
  (:class:`~lmcache.gpu_connector.checksums.StoreChecksums`). A layerwise store's calls each
  return the sums of their layers; the cache engine adds them up to each chunk's checksum.
- **Load, all layers.** The chunks come to staging. One ``checksum_chunks`` launch sums them and
  compares each with the sum stored with it. One ``scatter_kv`` launch then writes the chunks
  that matched. A chunk that did not match has its slots set to ``-1``, so none of its bytes
  reach the pools. The verdicts go back as :class:`~lmcache.gpu_connector.checksums.LoadChecks`.
- **Load, some layers** (a layerwise load). The ``scatter_kv`` launch returns the sums of the
  layers it moved; the cache engine adds the calls' sums and compares them at the end.

A chunk the engine holds entirely (``end <= skip_tokens``) is not staged. The tokens a staged
chunk shares with the engine are staged (they count in its sum) with slot ``-1`` (never
written). Every device call goes through the connector's device backend. Nothing here waits for
the device. This module never imports SGLang.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from lmcache import gpu_ops
from lmcache.gpu_connector.checksums import LoadChecks, StoreChecksums, pack_index, split_index
from lmcache.gpu_connector.device_checks import DeviceChecks
from lmcache.gpu_connector.interface import ChunkTransfer

if TYPE_CHECKING:
    from lmcache.devices import DeviceBackend

__all__ = ["KernelTransfer", "StagedIndex", "paged_kv"]


def _page_view(t: torch.Tensor, kv_layout: str) -> torch.Tensor:
    """``t`` as ``[pages, page_size, heads, dim]`` (a view of the same memory)."""
    if kv_layout == "token":
        return t.unsqueeze(1)  # [slots, 1, heads, dim]: page size 1
    if kv_layout == "paged_nhd":
        return t
    return t.transpose(1, 2)  # paged_hnd [pages, heads, page_size, dim]


def _uniform(views: Sequence[torch.Tensor]) -> bool:
    """Whether every view is laid out like the first, as the kernels require: the same shape,
    strides and dtype, a contiguous last axis and positive strides."""
    first = views[0]
    return all(
        v.shape == first.shape
        and v.stride() == first.stride()
        and v.dtype == first.dtype
        and (v.stride(3) == 1 or v.shape[3] == 1)
        and all(v.shape[d] == 1 or v.stride(d) > 0 for d in range(3))
        for v in views
    )


def paged_kv(layers: Sequence[tuple[torch.Tensor, ...]], kv_layout: str) -> gpu_ops.PagedKV | None:
    """The connector's per-layer pools as a :class:`~lmcache.gpu_ops.PagedKV`, or ``None`` when
    the kernels cannot address them (layers laid out differently, a strided last axis).

    Args:
        layers: Per layer ``(k, v)`` (MHA) or ``(latent,)`` (MLA), as the connector checked them.
        kv_layout: The connector's ``kv_layout`` (``"token"``, ``"paged_nhd"``, ``"paged_hnd"``).
    """
    k = tuple(_page_view(parts[0], kv_layout) for parts in layers)
    v = tuple(_page_view(parts[1], kv_layout) for parts in layers) if len(layers[0]) > 1 else ()
    if not _uniform(k) or (v and (not _uniform(v) or v[0].shape[:3] != k[0].shape[:3])):
        return None
    paged = gpu_ops.PagedKV(k, v)
    row_bytes = paged.kv_width * k[0].element_size()
    return paged if 0 < row_bytes < 1 << 30 else None


@dataclass(frozen=True)
class StagedIndex:
    """Where one transfer's staged chunks go, on the device (uploaded together in one copy).

    Attributes:
        positions: Position in the call's chunk list of each staged chunk.
        counts: Tokens of each staged chunk.
        offsets: ``[staged + 1]`` int64, the staging token offset of each staged chunk.
        slots: ``[tokens]`` int64, the pool slot of each staging token; ``-1``: not written.
        chunk_of: ``[tokens]`` int64, the staged chunk of each staging token.
        expected: ``[2 * staged]`` int64, :func:`~lmcache.gpu_connector.checksums.expected_sums`
            of the staged chunks.
    """

    positions: list[int]
    counts: list[int]
    offsets: torch.Tensor
    slots: torch.Tensor
    chunk_of: torch.Tensor
    expected: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return sum(self.counts)


class KernelTransfer:
    """Stores and loads of SGLang pools through the kernels, with device checksums (see the
    module docstring).

    Args:
        paged: The pools (:func:`paged_kv`).
        backend: The pools' device backend: every stream, copy and host buffer goes through it.
    """

    def __init__(self, paged: gpu_ops.PagedKV, backend: DeviceBackend) -> None:
        self.paged = paged
        self.device = paged.device
        self.backend = backend
        self.num_layers = paged.num_layers
        self.kv_width = paged.kv_width
        self.dtype = paged.dtype
        self.element_size = paged.k[0].element_size()
        self.checks = DeviceChecks(paged, backend)

    def index(
        self,
        chunks: Sequence[ChunkTransfer],
        positions: list[int],
        slots: torch.Tensor,
    ) -> StagedIndex:
        """The device index of the staged ``chunks[positions]``, whose tokens have host
        ``slots`` (checked, ``-1`` where not written), uploaded in one copy on the current stream.
        """
        counts = [chunks[p].num_tokens for p in positions]
        packed = pack_index(counts, slots, [chunks[p].checksum for p in positions])
        dev = self.checks.upload(packed)
        return StagedIndex(positions, counts, *split_index(dev, len(positions), sum(counts)))

    # -- store --------------------------------------------------------------------------------

    def store(
        self,
        layers: range,
        chunks: Sequence[ChunkTransfer],
        index: StagedIndex,
        on_engine_read: Callable[[], None] | None,
    ) -> StoreChecksums | None:
        """Enqueue the copy of ``layers`` of the chunks into their host buffers on the current
        stream, and each chunk's sum of those layers' bytes (returned, readable with the bytes):
        with all layers its checksum; with some, a part the engine adds up over the layers.
        ``None`` for some layers of rows that are not whole 64-bit words (the kernels sum a
        layer range only over whole words): the engine hashes such chunks on the host.
        """
        full = len(layers) == self.num_layers
        staging = self._staging(index, layers)
        sums = None
        if full or (self.kv_width * self.element_size) % 8 == 0:
            sums = self.checks.new_sums(len(index.positions))
        gpu_ops.gather_kv(
            self.paged, index.slots, index.offsets, staging, checksums=sums, layers=layers
        )
        if on_engine_read is not None:
            on_engine_read()  # the gather read the pools; the copies below read staging only
        hosts = [chunks[p].buffer[layers.start : layers.stop] for p in index.positions]
        self.backend.copy_batch(hosts, self._segments(staging, index, layers), self._stream())
        return StoreChecksums(self.checks.download(sums)) if sums is not None else None

    # -- load ---------------------------------------------------------------------------------

    def load(
        self, layers: range, chunks: Sequence[ChunkTransfer], index: StagedIndex
    ) -> LoadChecks | None:
        """Enqueue the copy of ``layers`` of the staged chunks into the pools on the current
        stream. Chunks with a ``checksum`` are checked: with all layers, a chunk is written only
        when it matches (the verdicts are returned); with some, the sums of the layers moved are
        returned. ``None``: nothing was checked."""
        staging = self._staging(index, layers)
        hosts = [chunks[p].buffer[layers.start : layers.stop] for p in index.positions]
        self.backend.copy_batch(self._segments(staging, index, layers), hosts, self._stream())
        if not any(chunks[p].checksum is not None for p in index.positions):
            gpu_ops.scatter_kv(self.paged, index.slots, index.offsets, staging, layers=layers)
            return None
        if len(layers) == self.num_layers:
            row_bytes = self.num_layers * self.kv_width * self.element_size
            return self.checks.verified_scatter(index, staging, row_bytes, layers)
        if (self.kv_width * self.element_size) % 8:
            # the kernels sum a layer range only over whole 64-bit words: the engine hashes
            gpu_ops.scatter_kv(self.paged, index.slots, index.offsets, staging, layers=layers)
            return None
        return self.checks.summed_scatter(index, staging, layers)

    # -- buffers ------------------------------------------------------------------------------

    def _stream(self) -> Any:
        return self.backend.current_stream(self.device)

    def _staging(self, index: StagedIndex, layers: range) -> torch.Tensor:
        """Chunk-major staging for ``layers`` of the staged chunks (uninitialised)."""
        n = index.num_tokens * len(layers) * self.kv_width
        return torch.empty(n, dtype=self.dtype, device=self.device)

    def _segments(
        self, staging: torch.Tensor, index: StagedIndex, layers: range
    ) -> list[torch.Tensor]:
        """Each staged chunk's ``[len(layers), n, kv_width]`` block of ``staging``."""
        out, at, nl = [], 0, len(layers)
        for n in index.counts:
            size = nl * n * self.kv_width
            out.append(staging[at : at + size].view(nl, n, self.kv_width))
            at += size
        return out
