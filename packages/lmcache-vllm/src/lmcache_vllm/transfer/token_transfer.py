# SPDX-License-Identifier: Apache-2.0
"""The layer-by-layer, token-by-token transfer strategy of
:class:`~lmcache_vllm.transfer.paged_connector.VLLMPagedConnector`.

Every block format of :mod:`lmcache_vllm.transfer.kv_formats` works here: each layer's moved tokens
are gathered (scattered) by ``(block, offset)`` through the format's token-level reference, via a
``[layers, tokens, kv_width]`` staging tensor (on the cache's device with
``config.gpu_staging_buffer``, else on the host). The connector uses it where no faster path
applies (layers in separate buffers with different strides, ``cpu_amx``, ``cpu_kt_v`` on a GPU,
no device staging), and the tests use it as the reference the fast paths must match bit for
bit. This module never imports vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from lmcache.gpu_connector.interface import ChunkTransfer, TransferSpec
from lmcache.gpu_connector.layer_range import moved_tokens, transfer_stream
from lmcache_vllm.transfer.kv_formats import gather_layer, scatter_layer
from lmcache_vllm.transfer.paged_cache import PagedKVCache, wait_for_transfer

if TYPE_CHECKING:
    from lmcache.devices import DeviceBackend

__all__ = ["TokenTransfer"]


class TokenTransfer:
    """Layer by layer, token by token, through a staging tensor (see the module docstring).

    Args:
        cache: The paged cache (any block format).
        backend: The cache device's backend (streams and the blocking wait).
        staging_device: Where the staging tensor lives: the cache's device, or the host.
    """

    def __init__(
        self, cache: PagedKVCache, backend: DeviceBackend, staging_device: torch.device
    ) -> None:
        self.cache = cache
        self.backend = backend
        self.staging_device = staging_device

    def _gather_layer(self, layer: int, blocks: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """KV of tokens at ``(blocks, offs)`` of one layer as ``[num_tokens, kv_width]``."""
        c = self.cache
        return gather_layer(c.kv_format, c.caches[layer], c.head_size_k, blocks, offs)

    def _scatter_layer(
        self, layer: int, blocks: torch.Tensor, offs: torch.Tensor, src: torch.Tensor
    ) -> None:
        """Write ``src`` ``[num_tokens, kv_width]`` into one layer's slots."""
        c = self.cache
        scatter_layer(
            c.kv_format,
            c.caches[layer],
            c.num_kv_heads,
            c.head_size_k,
            c.head_size_v,
            blocks,
            offs,
            src,
        )

    def _token_slots(
        self, chunks: Sequence[ChunkTransfer], transfer: TransferSpec, skip: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(positions in the staging tensor, block ids, block offsets)`` of moved tokens."""
        idx, pos, slots = moved_tokens(chunks, transfer, skip)
        self.cache.check_slots(slots, lambda: idx)
        bs, device = self.cache.block_size, self.cache.device
        blocks = torch.div(slots, bs, rounding_mode="floor")
        offs = slots - blocks * bs
        return pos.to(device), blocks.to(device), offs.to(device)

    def _staging(self, layers: int, num_tokens: int) -> torch.Tensor:
        c = self.cache
        return torch.empty(
            (layers, num_tokens, c.kv_width), dtype=c.dtype, device=self.staging_device
        )

    def from_cache(
        self, layers: range, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> None:
        pos, blocks, offs = self._token_slots(chunks, transfer, 0)
        with transfer_stream(self.backend, self.cache.device, transfer):
            staging = self._staging(len(layers), pos.numel())
            for i, layer in enumerate(layers):
                staging[i].copy_(self._gather_layer(layer, blocks, offs), non_blocking=True)
            start = 0
            for c in chunks:
                n = c.num_tokens
                dst = c.buffer[layers.start : layers.stop]
                dst.copy_(staging[:, start : start + n], non_blocking=True)
                start += n
        wait_for_transfer(self.backend, self.cache.device, transfer)

    def to_cache(
        self, layers: range, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> bool:
        pos, blocks, offs = self._token_slots(chunks, transfer, transfer.skip_tokens)
        if pos.numel() == 0:
            return False
        with transfer_stream(self.backend, self.cache.device, transfer):
            staging = self._staging(len(layers), sum(c.num_tokens for c in chunks))
            start = 0
            for c in chunks:
                n = c.num_tokens
                staging[:, start : start + n].copy_(
                    c.buffer[layers.start : layers.stop], non_blocking=True
                )
                start += n
            staging = staging.to(self.cache.device, non_blocking=True)
            for i, layer in enumerate(layers):
                self._scatter_layer(layer, blocks, offs, staging[i].index_select(0, pos))
        return True

    def close(self) -> None:
        """Nothing held beyond the cache's views."""
