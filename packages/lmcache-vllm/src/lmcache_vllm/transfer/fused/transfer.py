# SPDX-License-Identifier: Apache-2.0
"""The fused all-layer transfer strategy of
:class:`~lmcache_vllm.transfer.paged_connector.VLLMPagedConnector`.

It serves ``kv_concat`` and ``mla`` caches whose layers are views of one buffer with a uniform
step between layers (how vLLM allocates them), or that share strides.
Every transfer moves all chunks of a request at once, through one *chunk-major* staging buffer
on the device: chunk ``c``'s ``[num_layers, tokens, kv_width]`` block is contiguous there.
So each chunk, or each run of chunks whose host buffers lie back to back in one pool slab, moves
in one copy-engine DMA.
Every copy goes through the connector's device backend (:mod:`lmcache.devices`).

:class:`FusedTransfer` builds the parts from the
:class:`~lmcache_vllm.transfer.paged_cache.PagedKVCache` the connector checked, and holds them:

- :class:`~lmcache_vllm.transfer.fused.views.FusedViews`: the views, plans and host copies.
- :class:`~lmcache_vllm.transfer.fused.kernels.ChunkKernels`: the one-launch gather and scatter
  kernels, with the sums that guard each copy (a device with streams).
- :class:`~lmcache_vllm.transfer.fused.store.FusedStore`: a store's steps, in order.
- :class:`~lmcache_vllm.transfer.fused.load.FusedLoad`: a hit's steps, in order (copy ahead,
  verify ahead, scatter).

It reads nothing of the connector.
This module never imports vLLM.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from lmcache.gpu_connector.checksums import LoadChecks, StoreChecksums
from lmcache.gpu_connector.interface import ChunkTransfer, TransferSpec
from lmcache_vllm.transfer.fused.kernels import ChunkKernels
from lmcache_vllm.transfer.fused.load import FusedLoad
from lmcache_vllm.transfer.fused.plan import Prefetched, PreparedStore
from lmcache_vllm.transfer.fused.store import FusedStore
from lmcache_vllm.transfer.fused.views import FusedViews
from lmcache_vllm.transfer.paged_cache import PagedKVCache

if TYPE_CHECKING:
    from lmcache.devices import DeviceBackend

__all__ = ["FusedTransfer", "Prefetched"]

logger = logging.getLogger(__name__)


class FusedTransfer:
    """The fused all-layer path (see the module docstring).

    Args:
        cache: A ``kv_concat`` or ``mla`` cache.
        backend: The cache device's backend: every stream, event, pinned buffer and host copy
            goes through it.
        checksums: Stores sum their chunks on the device (loads verify whatever sums the
            chunks carry).
        kernels: The one-launch kernels. By default they are built on a device with streams,
            and warmed up. Tests pass their own to run them on the CPU, with no warm-up.

    Use :meth:`for_cache`, which returns ``None`` when the layers allow no fused views.
    """

    def __init__(
        self,
        cache: PagedKVCache,
        backend: DeviceBackend,
        checksums: bool = True,
        kernels: ChunkKernels | None = None,
    ) -> None:
        self.views = FusedViews(cache, backend)
        warm = kernels is None and backend.has_streams and self.views.usable
        if warm:
            kernels = ChunkKernels(cache, backend)
        self.kernels = kernels
        self.store = FusedStore(self.views, kernels, checksums)
        self.load = FusedLoad(self.views, kernels)
        if warm:
            self.warm_up()

    @classmethod
    def for_cache(
        cls, cache: PagedKVCache, backend: DeviceBackend, checksums: bool = True
    ) -> FusedTransfer | None:
        """The fused path of ``cache``, or ``None`` when its layers allow neither one view nor
        one view per layer (layers that differ in strides). ``checksums``: stores sum their
        chunks on the device (the configuration's ``checksum``)."""
        fused = cls(cache, backend, checksums)
        return fused if fused.views.usable else None

    @property
    def backend(self) -> DeviceBackend:
        """The cache device's backend (the views')."""
        return self.views.backend

    @property
    def num_layers(self) -> int:
        return self.views.num_layers

    @property
    def verifies_checksums(self) -> bool:
        """Whether stores sum their chunks on the device and loads verify them there (a
        device with streams)."""
        return self.kernels is not None

    def warm_up(self) -> None:
        """Run one store and one verified load of a single page, so that the first request
        finds streams, pinned index buffers, library symbols and kernels ready.

        The store reads page 0. The load writes the last token of page 0 back with the bytes
        just read from it (the others are skipped), so no page changes. The host buffer is
        released only once the device has passed every copy into or out of it.
        """
        views = self.views
        n = views.block_size
        nbytes = views.num_layers * n * views.layer_bytes
        host = self.backend.pinned_empty(nbytes).view(views.dtype)
        chunk = ChunkTransfer(0, n, host.view(views.num_layers, n, views.kv_width))
        slots = torch.arange(n, dtype=torch.int64)
        try:
            sums = self.from_cache(range(views.num_layers), [chunk], TransferSpec(slots))
            value = sums.values()[0] if sums is not None else None
            same = TransferSpec(slots, skip_tokens=n - 1)
            stored = dataclasses.replace(chunk, checksum=value)
            self.to_cache(range(views.num_layers), [stored], same)
        except Exception as exc:  # an optimisation: a first request then pays for it instead
            logger.warning("lmcache: warm-up transfer failed (%s); continuing without it", exc)
        finally:  # raw DMAs may still use ``host``: torch's pinned allocator does not know them
            self.backend.synchronize(views.device)

    # -- the connector's calls, each to its direction --------------------------------------------

    def from_cache(
        self, layers: range, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> StoreChecksums | None:
        """:meth:`FusedStore.store <lmcache_vllm.transfer.fused.store.FusedStore.store>`."""
        return self.store.store(layers, chunks, transfer)

    def plans_ahead(self, transfer: TransferSpec) -> bool:
        """:meth:`FusedStore.plans_ahead <lmcache_vllm.transfer.fused.store.FusedStore.plans_ahead>`."""
        return self.store.plans_ahead(transfer)

    def prepare_store(
        self, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> PreparedStore | None:
        """:meth:`FusedStore.prepare <lmcache_vllm.transfer.fused.store.FusedStore.prepare>`."""
        return self.store.prepare(chunks, transfer)

    def checked_ahead(self, chunks: Sequence[ChunkTransfer], transfer: TransferSpec) -> bool:
        """:meth:`FusedStore.checked_ahead
        <lmcache_vllm.transfer.fused.store.FusedStore.checked_ahead>`."""
        return self.store.checked_ahead(chunks, transfer)

    def prefetch(
        self, chunks: Sequence[ChunkTransfer], stream: Any, groups: Sequence[range] = ()
    ) -> Prefetched | None:
        """:meth:`FusedLoad.prefetch <lmcache_vllm.transfer.fused.load.FusedLoad.prefetch>`."""
        return self.load.prefetch(chunks, stream, groups)

    def verify_chunks(
        self, chunks: Sequence[ChunkTransfer], stream: Any, prefetched: Prefetched | None
    ) -> list[bool] | None:
        """:meth:`FusedLoad.verify_chunks
        <lmcache_vllm.transfer.fused.load.FusedLoad.verify_chunks>`."""
        return self.load.verify_chunks(chunks, stream, prefetched)

    def to_cache(
        self, layers: range, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> bool | LoadChecks:
        """:meth:`FusedLoad.load <lmcache_vllm.transfer.fused.load.FusedLoad.load>`."""
        return self.load.load(layers, chunks, transfer)

    def close(self) -> None:
        """Drop the views and the pinned buffers."""
        self.views.close()
        if self.kernels is not None:
            self.kernels.close()
