# SPDX-License-Identifier: Apache-2.0
"""A real connector over a simple paged CPU layout, for core tests and as an adapter template.

Layout: ``EngineInfo(name="mock", device="cpu", kv_caches=[layer_0, ...], extra={"page_size":
P})`` where every layer is a CPU tensor ``[num_pages, page_size, kv_width]`` of the metadata's
dtype, holding each token's KV already in the canonical row format. Tests register it with::

    register_gpu_connector("mock.cpu", "lmcache.testing.paged_cpu_connector:select")
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
from lmcache.gpu_connector.reference import gather_paged, scatter_paged

if TYPE_CHECKING:
    from lmcache.config import LMCacheConfig
    from lmcache.metadata import LMCacheMetadata

__all__ = ["PagedCPUConnector", "select"]


class PagedCPUConnector(GPUConnectorInterface, SupportsLayerwise):
    """Connector for per-layer CPU caches ``[num_pages, page_size, kv_width]``.

    Raises:
        KVLayoutError: at construction, when the caches do not match the layout or metadata.
    """

    def __init__(
        self,
        config: LMCacheConfig,
        metadata: LMCacheMetadata,
        engine: EngineInfo,
        layout_hints: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(config, metadata, engine, layout_hints)
        self._page_size = self._check_layout(metadata, engine)
        self._caches: list[torch.Tensor] = list(engine.kv_caches)

    @staticmethod
    def _check_layout(metadata: LMCacheMetadata, engine: EngineInfo) -> int:
        page_size = engine.extra.get("page_size")
        if not isinstance(page_size, int) or page_size <= 0:
            raise KVLayoutError(
                f"EngineInfo.extra['page_size'] must be a positive int, found {page_size!r}; "
                "pass extra={'page_size': P}."
            )
        if engine.device != "cpu":
            raise KVLayoutError(f"PagedCPUConnector serves device 'cpu', found {engine.device!r}.")
        if len(engine.kv_caches) != metadata.num_layers:
            raise KVLayoutError(
                f"Expected {metadata.num_layers} per-layer KV tensors (metadata.num_layers), "
                f"found {len(engine.kv_caches)}."
            )
        first_pages: int | None = None
        for layer, cache in enumerate(engine.kv_caches):
            if not isinstance(cache, torch.Tensor):
                raise KVLayoutError(
                    f"Layer {layer}: expected a tensor [num_pages, {page_size}, "
                    f"{metadata.kv_width}], found {type(cache).__name__}."
                )
            pages = cache.shape[0] if cache.dim() == 3 else -1
            expected = [pages, page_size, metadata.kv_width]
            if (
                cache.dim() != 3
                or list(cache.shape) != expected
                or (first_pages is not None and pages != first_pages)
            ):
                raise KVLayoutError(
                    f"Layer {layer}: expected KV shape [num_pages, page_size={page_size}, "
                    f"kv_width={metadata.kv_width}] with the same num_pages in every layer, "
                    f"found {list(cache.shape)}."
                )
            first_pages = pages
            if cache.dtype != metadata.kv_dtype:
                raise KVLayoutError(
                    f"Layer {layer}: expected dtype {metadata.kv_dtype} (metadata.kv_dtype), "
                    f"found {cache.dtype}."
                )
            if cache.device.type != "cpu":
                raise KVLayoutError(f"Layer {layer}: expected a CPU tensor, found {cache.device}.")
        return page_size

    @property
    def num_layers(self) -> int:
        return len(self._caches)

    @property
    def dtype(self) -> torch.dtype:
        return self.metadata.kv_dtype

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer} is outside [0, {self.num_layers}).")

    def _gather_layer(
        self, layer: int, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> None:
        slots = torch.cat([transfer.slot_mapping[c.start : c.end] for c in chunks])
        rows = gather_paged(
            self._caches[layer], slots, page_axis=0, offset_axis=1, page_size=self._page_size
        )
        offset = 0
        for chunk in chunks:
            chunk.buffer[layer].copy_(rows[offset : offset + chunk.num_tokens])
            offset += chunk.num_tokens

    def _scatter_layer(
        self, layer: int, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> None:
        skip = transfer.skip_tokens
        parts = [
            (max(c.start, skip), c) for c in chunks if c.end > skip
        ]  # (first token to write, chunk)
        if not parts:
            return
        slots = torch.cat([transfer.slot_mapping[lo : c.end] for lo, c in parts])
        values = torch.cat([c.buffer[layer, lo - c.start :] for lo, c in parts])
        scatter_paged(
            self._caches[layer],
            slots,
            values,
            page_axis=0,
            offset_axis=1,
            page_size=self._page_size,
        )

    def from_gpu(self, chunks: Sequence[ChunkTransfer], transfer: TransferSpec) -> None:
        """Gather every chunk's tokens into its buffer ``[num_layers, num_tokens, kv_width]``."""
        self.check_chunks(chunks, transfer)
        if not chunks:
            return
        for layer in range(self.num_layers):
            self._gather_layer(layer, chunks, transfer)

    def to_gpu(self, chunks: Sequence[ChunkTransfer], transfer: TransferSpec) -> None:
        """Scatter every chunk buffer into the engine, except the first ``skip_tokens`` tokens."""
        self.check_chunks(chunks, transfer)
        for layer in range(self.num_layers):
            self._scatter_layer(layer, chunks, transfer)

    def from_gpu_layer(
        self, layer: int, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> None:
        """Gather layer ``layer`` of every chunk into ``buffer[layer]``."""
        self._check_layer(layer)
        self.check_chunks(chunks, transfer)
        if chunks:
            self._gather_layer(layer, chunks, transfer)

    def to_gpu_layer(
        self, layer: int, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> None:
        """Scatter ``buffer[layer]`` of every chunk into layer ``layer`` of the engine."""
        self._check_layer(layer)
        self.check_chunks(chunks, transfer)
        self._scatter_layer(layer, chunks, transfer)


def select(
    config: LMCacheConfig,
    metadata: LMCacheMetadata,
    engine: EngineInfo,
    layout_hints: Mapping[str, Any] | None,
) -> type[GPUConnectorInterface] | None:
    """Selector for ``"mock.cpu"``: :class:`PagedCPUConnector` for CPU engines, else ``None``."""
    if engine.device != "cpu":
        return None
    return PagedCPUConnector
