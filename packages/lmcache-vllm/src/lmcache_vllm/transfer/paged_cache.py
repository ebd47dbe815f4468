# SPDX-License-Identifier: Apache-2.0
"""What the transfer strategies of
:class:`~lmcache_vllm.transfer.paged_connector.VLLMPagedConnector` share.

- :class:`PagedKVCache`: the engine's paged KV cache as the connector found and checked it (the
  per-layer views, their block format, block size, heads and dtype), handed to a strategy at
  construction. A strategy reads nothing else of the connector.
- :class:`PagedTransfer`: what a strategy does, "layers ``range(a, b)`` of these chunks" in each
  direction. The strategies are :class:`~lmcache_vllm.transfer.fused.transfer.FusedTransfer` (all
  layers per op, chunk-major staging),
  :class:`~lmcache_vllm.transfer.cpu_block_transfer.CpuBlockTransfer` (vLLM's CPU block formats,
  block by block) and
  :class:`~lmcache_vllm.transfer.token_transfer.TokenTransfer` (layer by layer, token by token: the
  reference).
- :func:`fuse_layers`: all layers as one strided view when they are views of one buffer.
- :func:`wait_for_transfer`: the blocking wait for a transfer's stream.

This module never imports vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from lmcache.devices import DeviceBackend
    from lmcache.gpu_connector.checksums import LoadChecks, StoreChecksums
    from lmcache.gpu_connector.interface import ChunkTransfer, TransferSpec

__all__ = ["PagedKVCache", "PagedTransfer", "fuse_layers", "wait_for_transfer"]


@dataclass(frozen=True)
class PagedKVCache:
    """vLLM's paged KV cache, checked against the geometry (see the connector's docstring).

    Attributes:
        caches: Per-layer views in layer order: ``[num_blocks, num_kv_heads, block_size,
            head_size_k + head_size_v]`` (``kv_concat``, ``cpu_kt_v``, ``cpu_amx``) or
            ``[num_blocks, block_size, latent]`` (``mla``), all of one shape, dtype and device.
        kv_format: The block format (:data:`lmcache_vllm.transfer.kv_formats.KV_FORMATS`).
        block_size: Tokens per block (axis -2 of every view).
        num_blocks: Blocks per layer (axis 0).
        num_kv_heads: KV heads per token (1 for MLA).
        head_size_k: K head size (the latent size for MLA).
        head_size_v: V head size (0 for MLA).
        kv_width: Elements per token per layer in the canonical chunk format.
    """

    caches: tuple[torch.Tensor, ...]
    kv_format: str
    block_size: int
    num_blocks: int
    num_kv_heads: int
    head_size_k: int
    head_size_v: int
    kv_width: int

    @property
    def num_layers(self) -> int:
        return len(self.caches)

    @property
    def dtype(self) -> torch.dtype:
        return self.caches[0].dtype

    @property
    def device(self) -> torch.device:
        return self.caches[0].device

    def check_slots(self, slots: torch.Tensor, token_ids: Callable[..., torch.Tensor]) -> None:
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


class PagedTransfer(Protocol):
    """A transfer strategy: moves layers of chunks between the paged cache and the chunk
    buffers. Both methods are called with at least one chunk, already checked
    (:meth:`~lmcache.gpu_connector.interface.GPUConnectorInterface.check_chunks`)."""

    def from_cache(
        self, layers: range, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> StoreChecksums | None:
        """Copy ``layers`` of the chunks' tokens into ``buffer[layers]``; return when they are
        on the host (or, ``transfer.deferred``, once the copies are enqueued).

        Returns:
            The chunks' checksums when the strategy computes them on the device, else ``None``.
        """

    def to_cache(
        self, layers: range, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> bool | LoadChecks:
        """Copy ``buffer[layers]`` of the chunks into the cache, except ``skip_tokens``.

        Returns:
            ``False`` when nothing moved. Otherwise the copies are enqueued on
            ``transfer.stream`` (what the connector's ``synchronize`` then waits for), and the
            result is ``True`` or, for a strategy that checks chunks on the device, their
            :class:`~lmcache.gpu_connector.checksums.LoadChecks`.
        """

    def close(self) -> None:
        """Drop the views, staging and pinned buffers."""


def fuse_layers(caches: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """All layers as one strided view ``[layers, *layer_shape]``, or ``None``.

    Possible when every layer is a view of one storage with the same shape and strides and a
    uniform, non-overlapping element step between consecutive layers (vLLM's allocation).
    """
    first = caches[0]
    if first.numel() == 0:
        return None
    span = 1 + sum(
        (int(n) - 1) * abs(int(st)) for n, st in zip(first.shape, first.stride(), strict=True)
    )
    step = (
        int(caches[1].storage_offset()) - int(first.storage_offset()) if len(caches) > 1 else span
    )
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


def wait_for_transfer(backend: DeviceBackend, device: torch.device, transfer: TransferSpec) -> None:
    """Wait for the transfer's stream, asleep (a blocking-sync event): the caller may be a save
    thread waiting through a whole forward, which must not spin a core that the engine's own
    thread could be sharing."""
    if backend.has_streams:
        stream = transfer.stream or backend.current_stream(device)
        backend.event_synchronize(backend.event_after(stream, blocking=True))
