# SPDX-License-Identifier: Apache-2.0
"""The GPU connector interface: how KV moves between an engine's paged memory and lmcache.

Lifecycle, as the cache engine drives it:

1. **Creation.** An adapter builds an :class:`EngineInfo` describing the engine's KV cache
   (``name`` such as ``"vllm"``, ``device`` such as ``"cuda"``, and the per-layer KV tensors) and
   calls :func:`lmcache.gpu_connector.CreateGPUConnector`. The registry finds the connector class
   for ``engine.key`` (``"vllm.cuda"``) and constructs it as ``cls(config, metadata, engine,
   layout_hints)``. The constructor reads the geometry from the tensors' shapes and strides and
   raises :class:`KVLayoutError` for a layout it cannot handle, before any byte moves.
2. **Store.** The cache engine cuts the request into chunks, leases one host buffer per chunk
   that must be saved (logical shape :meth:`GPUConnectorInterface.chunk_shape`, i.e.
   ``[num_layers, chunk_tokens, kv_width]``), and calls :meth:`~GPUConnectorInterface.from_gpu`
   *once* with all of them. The connector gathers the tokens' KV from the paged cache (using
   ``transfer.slot_mapping``) into those buffers and returns when the bytes are on the host.
3. **Retrieve.** The cache engine leases the hit chunks and calls
   :meth:`~GPUConnectorInterface.to_gpu` *once*; the connector scatters the buffers into the
   engine's slots, except the first ``transfer.skip_tokens`` tokens of the request, which the
   engine already holds (they may live in pages shared with running requests: never write them).
4. **Layerwise** (optional, :class:`SupportsLayerwise`): the same, one layer at a time, so loads
   and saves overlap the forward pass.

The chunk buffer format (canonical, the same for every connector so bytes are comparable):
``[num_layers, num_tokens, kv_width]`` where for MHA ``kv_width = num_kv_heads * head_size_k +
num_kv_heads * head_size_v`` (all K heads, then all V heads, each ``[heads, head_size]`` row
major) and for MLA ``kv_width = latent_size`` (one latent per token per layer).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from lmcache.errors import KVLayoutError

if TYPE_CHECKING:
    from lmcache.config import LMCacheConfig
    from lmcache.gpu_connector.checksums import LoadChecks, StoreChecksums
    from lmcache.metadata import LMCacheMetadata

__all__ = [
    "ChunkTransfer",
    "EngineInfo",
    "GPUConnectorInterface",
    "KVLayoutError",
    "SupportsLayerwise",
    "TransferSpec",
    "supports_layerwise",
]


@dataclass(frozen=True)
class EngineInfo:
    """What a connector needs to know about the engine it serves.

    Attributes:
        name: Engine name, e.g. ``"vllm"``, ``"sglang"``, ``"mock"``.
        device: Device kind of the KV cache, e.g. ``"cuda"``, ``"cpu"``, ``"xpu"``.
        kv_caches: The engine's KV tensors, one entry per layer, in layer order. Each entry is a
            tensor or a tuple of tensors (e.g. SGLang's separate K and V pools); the connector
            interprets them.
        extra: Engine-specific facts (e.g. ``{"block_size": 32}``).
    """

    name: str
    device: str
    kv_caches: Sequence[Any]
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        """Registry key ``"<engine>.<device>"``, e.g. ``"vllm.cuda"``."""
        return f"{self.name}.{self.device}"


@dataclass(frozen=True)
class TransferSpec:
    """One request's transfer description, shared by all of its chunks.

    Attributes:
        slot_mapping: ``[num_tokens]`` int64, the engine slot of every token of the request
            (``slot = page_id * page_size + offset``), on any device. Entries for tokens that are
            not transferred may be ``-1``.
        skip_tokens: On load, the first ``skip_tokens`` tokens of the request are held by the
            engine already and their slots must not be written. Ignored on store.
        stream: CUDA (or XPU) stream to run the copies on; ``None`` means the current stream.
        deferred: Store only, with ``stream`` set: ``from_gpu`` may return once its copies are
            *enqueued* on ``stream`` instead of complete; the host buffers hold the bytes only
            after work enqueued on ``stream`` after that return completes (record an event there
            and synchronize it before reading them). Connectors that cannot defer complete the
            copies as usual, which is always allowed.
        on_engine_read: Store only: called once, on the calling thread, as soon as every read of
            the engine's memory by this transfer is enqueued on ``stream`` (the current stream
            then), before the copies to the host complete. Work ordered after an event recorded
            on ``stream`` at that moment may rewrite the engine's pages. A connector that does
            not call it reads them until ``from_gpu`` returns (and, deferred, until its copies
            complete).
        staged: Load only: what the connector's own ``prefetch`` returned for these chunks (a
            device copy of their bytes, made earlier); a connector that finds it covers the
            chunks scatters from it instead of copying from the host, else ignores it.
        prepared: Store only: what this connector's :meth:`GPUConnectorInterface.prepare_store`
            returned for the same chunk list and slot mapping (host-side planning done ahead);
            a connector that finds it matches skips that planning, else ignores it.
    """

    slot_mapping: torch.Tensor
    skip_tokens: int = 0
    stream: Any = None
    deferred: bool = False
    on_engine_read: Callable[[], None] | None = None
    staged: Any = None
    prepared: Any = None


@dataclass(frozen=True)
class ChunkTransfer:
    """One chunk of a request: token range ``[start, end)`` and its host buffer.

    Attributes:
        start: First token index of the chunk within the request.
        end: One past the last token index.
        buffer: Host tensor of logical shape ``[num_layers, end - start, kv_width]`` and the
            KV dtype (see :meth:`GPUConnectorInterface.chunk_shape`).
        checksum: Load only: the ``lmcache-mix64-sum`` the buffer's bytes had when they were
            stored, or ``None``. A connector that :attr:`~GPUConnectorInterface.
            verifies_checksums` scatters the chunk only when its staged bytes match it.
    """

    start: int
    end: int
    buffer: torch.Tensor
    checksum: int | None = None

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


class GPUConnectorInterface(ABC):
    """Moves KV between an engine's paged memory and host chunk buffers.

    Subclasses are constructed as ``cls(config, metadata, engine, layout_hints)`` by
    :func:`lmcache.gpu_connector.CreateGPUConnector`.
    """

    def __init__(
        self,
        config: LMCacheConfig,
        metadata: LMCacheMetadata,
        engine: EngineInfo,
        layout_hints: Mapping[str, Any] | None = None,
    ) -> None:
        self.config = config
        self.metadata = metadata
        self.engine = engine
        self.layout_hints: Mapping[str, Any] = dict(layout_hints or {})

    @property
    @abstractmethod
    def num_layers(self) -> int:
        """Number of attention layers the connector moves."""

    @property
    def kv_width(self) -> int:
        """Elements per token per layer in the canonical chunk format (``metadata.kv_width``)."""
        return self.metadata.kv_width

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype:
        """KV element dtype."""

    def chunk_shape(self, num_tokens: int) -> tuple[int, int, int]:
        """Logical chunk buffer shape ``[num_layers, num_tokens, kv_width]``."""
        return (self.num_layers, num_tokens, self.kv_width)

    def chunk_nbytes(self, num_tokens: int) -> int:
        """Bytes of one chunk buffer of ``num_tokens`` tokens."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * num_tokens * self.kv_width * itemsize

    def check_chunks(self, chunks: Sequence[ChunkTransfer], transfer: TransferSpec) -> None:
        """Validate chunk buffers against the geometry before any byte moves.

        Raises:
            ValueError: the slot mapping is not 1-D, a chunk's token range is empty or outside
                the slot mapping, or a buffer's shape, dtype or device (host) is wrong.
        """
        sm = transfer.slot_mapping
        if sm.dim() != 1:
            raise ValueError(f"slot_mapping must be [num_tokens], found {list(sm.shape)}.")
        num_tokens = sm.shape[0]
        for i, chunk in enumerate(chunks):
            if not 0 <= chunk.start < chunk.end <= num_tokens:
                raise ValueError(
                    f"Chunk {i}: token range [{chunk.start}, {chunk.end}) is not a non-empty "
                    f"range inside the slot mapping's {num_tokens} tokens."
                )
            expected = self.chunk_shape(chunk.num_tokens)
            buf = chunk.buffer
            if tuple(buf.shape) != expected:
                raise ValueError(
                    f"Chunk {i}: buffer shape {list(buf.shape)} does not match the expected "
                    f"[num_layers, num_tokens, kv_width] = {list(expected)}; allocate it with "
                    "connector.chunk_shape(num_tokens)."
                )
            if buf.dtype != self.dtype:
                raise ValueError(
                    f"Chunk {i}: buffer dtype {buf.dtype} does not match the KV dtype {self.dtype}."
                )
            if buf.device.type != "cpu":
                raise ValueError(f"Chunk {i}: buffer must be a host tensor, found {buf.device}.")

    @property
    def verifies_checksums(self) -> bool:
        """Whether the connector computes chunk checksums on the device (``False`` here).

        Such a connector returns :class:`~lmcache.gpu_connector.checksums.StoreChecksums` from
        :meth:`from_gpu` and :class:`~lmcache.gpu_connector.checksums.LoadChecks` from
        :meth:`to_gpu`. The cache engine verifies the chunks of any other connector on the
        host."""
        return False

    @abstractmethod
    def from_gpu(
        self, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> StoreChecksums | None:
        """Copy the KV of every chunk's tokens from the engine into the chunk buffers.

        One batched transfer for all chunks; returns when the host buffers hold the bytes.
        A connector that :attr:`verifies_checksums` returns the chunks' checksums (readable
        once the copies are complete); others return ``None``.

        Raises:
            ValueError: a buffer's shape/dtype does not match :meth:`chunk_shape`/``dtype``, or
                the slot mapping does not cover the chunks.
        """

    def prepare_store(self, chunks: Sequence[ChunkTransfer], transfer: TransferSpec) -> Any:
        """Optional: plan a later :meth:`from_gpu` of ``chunks`` ahead of it, before the engine
        has written the KV (e.g. while its forward pass runs), so the copy itself starts with
        less host work. Must not read the engine's memory; device work it enqueues goes on
        ``transfer.stream`` (or the current stream), where the later copy must run too.

        Returns:
            An opaque object for ``TransferSpec.prepared`` of that later call, or ``None``
            (the default: nothing to prepare).

        Raises:
            ValueError: as for :meth:`from_gpu`.
        """
        return None

    @abstractmethod
    def to_gpu(self, chunks: Sequence[ChunkTransfer], transfer: TransferSpec) -> LoadChecks | None:
        """Copy every chunk buffer into the engine's slots, skipping ``transfer.skip_tokens``.

        One batched transfer for all chunks. When it returns, the copies are enqueued on
        ``transfer.stream`` (or complete, for CPU engines); :meth:`synchronize` waits for them.
        A connector that :attr:`verifies_checksums` returns what it checked of the chunks
        with a ``checksum`` (readable after :meth:`synchronize`); others return ``None``.

        Raises:
            ValueError: as for :meth:`from_gpu`.
        """

    def synchronize(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Wait until every copy this connector enqueued has finished."""

    def close(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Release staging buffers, streams and other resources."""


class SupportsLayerwise(ABC):
    """Capability mixin: per-layer transfers for pipelining loads/saves with the forward pass."""

    @abstractmethod
    def from_gpu_layer(
        self, layer: int, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> StoreChecksums | None:
        """Like :meth:`GPUConnectorInterface.from_gpu`, for ``buffer[layer]`` of each chunk only.

        A connector that sums on the device returns each chunk's sum of this layer's bytes
        (at their place in the chunk): a chunk's sums over all layers add up, modulo 2**64,
        to its checksum. ``None``: nothing summed (the engine hashes the chunks on the host).
        """

    @abstractmethod
    def to_gpu_layer(
        self, layer: int, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> LoadChecks | None:
        """Like :meth:`GPUConnectorInterface.to_gpu`, for ``buffer[layer]`` of each chunk only."""

    def to_gpu_layers(
        self, layers: range, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> LoadChecks | None:
        """Like :meth:`to_gpu_layer` for a contiguous range of layers (step 1).

        The default calls :meth:`to_gpu_layer` per layer; a connector that can move several
        layers in one transfer overrides it (fewer, larger copies when a layerwise load
        prefetches ahead of the forward).
        """
        for layer in layers:
            self.to_gpu_layer(layer, chunks, transfer)
        return None  # per-layer checks are not combined here: the engine verifies on the host


def supports_layerwise(connector: GPUConnectorInterface) -> bool:
    """Whether ``connector`` implements :class:`SupportsLayerwise`."""
    return isinstance(connector, SupportsLayerwise)
