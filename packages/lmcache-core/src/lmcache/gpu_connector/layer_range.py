# SPDX-License-Identifier: Apache-2.0
"""Engine-neutral pieces of slot-mapped connectors (the vLLM and SGLang ones share them).

- :class:`LayerRangeConnector`: a layerwise :class:`~.interface.GPUConnectorInterface` whose
  transfers all reduce to "layers ``range(a, b)`` of these chunks": a subclass writes two
  methods, ``_from`` and ``_to``, and gets ``from_gpu``/``to_gpu``, the per-layer methods,
  ``to_gpu_layers``, the stream ordering and ``synchronize``.
- :func:`moved_tokens`: which tokens of the chunks a transfer moves, and their slots.
- :func:`engine_selector`: the registry selector of a ``"<engine>.<device>"`` key.
- :func:`transfer_stream`: the stream context a transfer's copies run in.

Nothing here imports an engine.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from lmcache.gpu_connector.checksums import LoadChecks, StoreChecksums
from lmcache.gpu_connector.interface import (
    ChunkTransfer,
    EngineInfo,
    GPUConnectorInterface,
    SupportsLayerwise,
    TransferSpec,
)

if TYPE_CHECKING:
    from lmcache.config import LMCacheConfig
    from lmcache.devices.backend import DeviceBackend
    from lmcache.gpu_connector.registry import ConnectorSelector
    from lmcache.metadata import LMCacheMetadata

__all__ = ["LayerRangeConnector", "engine_selector", "moved_tokens", "transfer_stream"]


def moved_tokens(
    chunks: Sequence[ChunkTransfer], transfer: TransferSpec, skip: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(token ids, positions, slots)`` of the chunks' tokens from token ``skip`` on.

    ``token ids`` index the request, ``positions`` the chunks laid end to end (a staging
    tensor's rows), ``slots`` are ``transfer.slot_mapping`` at those tokens (host, int64,
    unchecked).
    """
    idx = torch.cat([torch.arange(c.start, c.end) for c in chunks])
    pos = torch.arange(idx.numel())
    if skip > 0:
        keep = idx >= skip
        idx, pos = idx[keep], pos[keep]
    return idx, pos, transfer.slot_mapping.to("cpu", torch.int64)[idx]


def transfer_stream(backend: DeviceBackend, device: torch.device, transfer: TransferSpec) -> Any:
    """Run on ``transfer.stream``, ordered after the work already queued on ``device``'s current
    stream (the engine's writes of the KV being saved, or its reads of the pages)."""
    if backend.has_streams and transfer.stream is not None:
        backend.wait_stream(transfer.stream, backend.current_stream(device))
    return backend.use_stream(transfer.stream)


class LayerRangeConnector(GPUConnectorInterface, SupportsLayerwise):
    """A layerwise connector built on two range transfers.

    A subclass sets ``device`` (the KV cache's) and ``backend`` (``lmcache.devices.get_backend
    (device)``: every stream, event and synchronisation goes through it) and implements
    :meth:`_from` and :meth:`_to`; both are called only with at least one chunk, after
    :meth:`check_chunks`. ``_to`` records the stream it enqueued on in ``_last_stream`` (what
    :meth:`synchronize` waits for).
    """

    device: torch.device
    backend: DeviceBackend
    _last_stream: Any = None

    @abstractmethod
    def _from(self, layers: range, chunks: Sequence[ChunkTransfer], transfer: TransferSpec) -> Any:
        """Copy ``layers`` of the chunks' tokens into ``buffer[layers]``; return when on host.

        Returns the chunks' :class:`~lmcache.gpu_connector.checksums.StoreChecksums` (all
        layers only) or ``None``."""

    @abstractmethod
    def _to(self, layers: range, chunks: Sequence[ChunkTransfer], transfer: TransferSpec) -> Any:
        """Copy ``buffer[layers]`` of the chunks into the engine, except ``skip_tokens``.

        Returns the :class:`~lmcache.gpu_connector.checksums.LoadChecks` of the call or
        ``None``."""

    def _checked(
        self,
        op: Callable[[range, Sequence[ChunkTransfer], TransferSpec], Any],
        layers: range,
        chunks: Sequence[ChunkTransfer],
        transfer: TransferSpec,
    ) -> Any:
        if not chunks:
            return None
        if not self._checked_ahead(chunks, transfer):
            self.check_chunks(chunks, transfer)
        return op(layers, chunks, transfer)

    def _checked_ahead(self, chunks: Sequence[ChunkTransfer], transfer: TransferSpec) -> bool:
        """Whether :meth:`prepare_store` has run :meth:`check_chunks` on these very chunks and
        slot mapping (``transfer.prepared``), so a copy need not check them again; never by
        default."""
        return False

    def from_gpu(
        self, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> StoreChecksums | None:
        sums = self._checked(self._from, range(self.num_layers), chunks, transfer)
        return sums if isinstance(sums, StoreChecksums) else None

    def to_gpu(self, chunks: Sequence[ChunkTransfer], transfer: TransferSpec) -> LoadChecks | None:
        return self._load(range(self.num_layers), chunks, transfer)

    def from_gpu_layer(
        self, layer: int, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> StoreChecksums | None:
        sums = self._checked(self._from, range(layer, layer + 1), chunks, transfer)
        return sums if isinstance(sums, StoreChecksums) else None

    def to_gpu_layer(
        self, layer: int, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> LoadChecks | None:
        return self._load(range(layer, layer + 1), chunks, transfer)

    def to_gpu_layers(
        self, layers: range, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> LoadChecks | None:
        """Several layers in one transfer (one :meth:`_to` over the range)."""
        return self._load(layers, chunks, transfer)

    def _load(
        self, layers: range, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> LoadChecks | None:
        checks = self._checked(self._to, layers, chunks, transfer)
        return checks if isinstance(checks, LoadChecks) else None

    def _stream_ctx(self, transfer: TransferSpec) -> Any:
        """:func:`transfer_stream` of this connector's device."""
        return transfer_stream(self.backend, self.device, transfer)

    def synchronize(self) -> None:
        backend = self.backend
        if backend.has_streams:
            backend.stream_synchronize(self._last_stream or backend.current_stream(self.device))


def engine_selector(
    engine_name: str, device: str, connector: type[GPUConnectorInterface]
) -> ConnectorSelector:
    """The selector of key ``"<engine_name>.<device>"``: ``connector`` for an engine of that name
    on that device, else ``None`` (for the ``lmcache.gpu_connectors`` entry points)."""

    def select(
        config: LMCacheConfig,
        metadata: LMCacheMetadata,
        engine: EngineInfo,
        layout_hints: Mapping[str, Any] | None = None,
    ) -> type[GPUConnectorInterface] | None:
        if engine.name != engine_name or engine.device != device:
            return None
        return connector

    select.__doc__ = (
        f"Selector for ``{engine_name}.{device}`` (entry point ``lmcache.gpu_connectors``)."
    )
    return select
