# SPDX-License-Identifier: Apache-2.0
"""Layerwise store and retrieve: one connector call per layer, to overlap with the forward pass.

:meth:`lmcache.cache_engine.LMCacheEngine.store_layerwise` and
:meth:`~lmcache.cache_engine.LMCacheEngine.retrieve_layerwise` plan the request (keys, leases)
and return one of these plain objects; the caller drives it layer by layer, in order, then calls
``finish()`` (or ``abort()``). Chunks of a layerwise store become visible to lookups at
``finish()``; a layerwise retrieve keeps its chunk leases until the copies are done.

A batched store can be split the same way: :class:`PlannedStore` (keys, leases and the
connector's planning, before the engine has computed the KV), then :class:`StagedStore` (the
bytes copied, not yet visible), then ``commit()``. :class:`StoreBatch` copies several planned
stores in one connector call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from lmcache.gpu_connector.checksums import LoadChecks, StoreChecksums
from lmcache.gpu_connector.interface import (
    ChunkTransfer,
    GPUConnectorInterface,
    SupportsLayerwise,
    TransferSpec,
)
from lmcache.memory import MemoryLease

if TYPE_CHECKING:
    from lmcache.cache_engine import LMCacheEngine

__all__ = [
    "LayerwiseRetrieve",
    "LayerwiseStore",
    "Pending",
    "PlannedStore",
    "StagedStore",
    "StoreBatch",
    "release_all",
]


@dataclass(frozen=True)
class Pending:
    """A chunk being moved: its key, the connector's view of it, and the lease on its buffer.

    ``parent`` is the previous chunk's key in the request's chain (``None`` for chunk 0), which
    a store records in the tiers for their eviction order.
    """

    key: bytes
    chunk: ChunkTransfer
    lease: MemoryLease
    parent: bytes | None = None


def release_all(pending: Sequence[Pending]) -> None:
    """Release every lease not released yet."""
    for p in pending:
        if not p.lease.released:
            p.lease.release()


class StagedStore:
    """A store whose bytes are copied into leased host buffers but not yet visible.

    :meth:`lmcache.cache_engine.LMCacheEngine.copy_out` returns it once the connector's copy is
    complete, so the engine's pages may be reused from then on; :meth:`commit` then checksums
    the buffers and hands them to the tier (on another thread if the caller likes: it only
    reads host memory). :meth:`abort` drops them.

    When the connector computed the chunks' checksums on the device, ``sums`` holds them from
    position ``sums_at`` on (a batch's stores share one result).
    """

    def __init__(
        self,
        engine: LMCacheEngine,
        pending: list[Pending],
        chain: Sequence[bytes],
        started: float,
        sums: StoreChecksums | None = None,
        sums_at: int = 0,
    ) -> None:
        self._engine = engine
        self._pending = pending
        self._chain = chain
        self._started = started
        self.sums = sums
        self.sums_at = sums_at
        self._done = False

    @property
    def num_tokens(self) -> int:
        """Tokens :meth:`commit` will store."""
        return sum(p.chunk.num_tokens for p in self._pending)

    def commit(self) -> int:
        """Checksum and publish the chunks; returns the number of tokens stored.

        Raises:
            RuntimeError: committed or aborted already.
        """
        if self._done:
            raise RuntimeError("StagedStore.commit(): committed or aborted already.")
        self._done = True
        if not self._pending:
            return 0
        try:
            sums = None
            if self.sums is not None:
                sums = self.sums.values()[self.sums_at : self.sums_at + len(self._pending)]
            return self._engine._commit_store(self._pending, self._started, self._chain, sums)
        finally:
            release_all(self._pending)

    def abort(self) -> None:
        """Release the buffers without publishing anything (idempotent)."""
        self._done = True
        release_all(self._pending)


def _copy_or_abort(
    connector: GPUConnectorInterface,
    chunks: Sequence[ChunkTransfer],
    spec: TransferSpec,
    staged: Sequence[StagedStore],
) -> StoreChecksums | None:
    """One ``from_gpu`` call, returning the checksums it computed; on any error every staged
    store's buffers go back, then it is raised."""
    try:
        return connector.from_gpu(chunks, spec)
    except BaseException:
        for st in staged:
            st.abort()
        raise


class PlannedStore:
    """A store whose chunks are chosen and whose host buffers are leased, nothing copied yet.

    :meth:`lmcache.cache_engine.LMCacheEngine.plan_store` returns it, so the host-side work of a
    store (hashing, leasing, the connector's :meth:`~lmcache.gpu_connector.GPUConnectorInterface.
    prepare_store`) can run before the engine has computed the KV; :meth:`copy_out` then copies
    it (``copy_out`` of the engine is ``plan_store(...).copy_out()``). :meth:`abort` drops it.
    """

    def __init__(
        self,
        engine: LMCacheEngine,
        connector: GPUConnectorInterface,
        pending: list[Pending],
        chain: Sequence[bytes],
        transfer: TransferSpec,
        started: float,
        *,
        prepare: bool = True,
    ) -> None:
        self._engine = engine
        self._gpu = connector
        self._pending = pending
        self._chain = chain
        self._chunks = [p.chunk for p in pending]
        self._slots = transfer.slot_mapping
        self._prepared = None
        if prepare and pending:
            self._prepared = connector.prepare_store(self._chunks, transfer)
        self._started = started
        self._done = False

    @property
    def num_tokens(self) -> int:
        """Tokens this store saves (chunks whose buffers were leased)."""
        return sum(c.num_tokens for c in self._chunks)

    def copy_out(self, transfer: TransferSpec | None = None) -> StagedStore:
        """Copy the chunks out of the engine (one ``from_gpu`` call) into their buffers.

        Args:
            transfer: How to copy (stream, ``deferred``, ``on_engine_read``); its slot mapping
                must be the one given to ``plan_store``. ``None``: that transfer as it was.

        Returns:
            The staged store, to ``commit()`` (see :class:`StagedStore`).

        Raises:
            RuntimeError: copied or aborted already.
            ValueError: ``transfer`` has another slot mapping.
            Errors of the connector are raised as they are (the buffers are released).
        """
        if self._done:
            raise RuntimeError("PlannedStore.copy_out(): copied or aborted already.")
        if transfer is not None and transfer.slot_mapping is not self._slots:
            raise ValueError(
                "PlannedStore.copy_out(): the transfer's slot mapping is not the one the store "
                "was planned with; pass the same TransferSpec.slot_mapping tensor."
            )
        staged = self._stage()
        if self._pending:
            spec = TransferSpec(self._slots) if transfer is None else transfer
            spec = dataclasses.replace(spec, prepared=self._prepared)
            staged.sums = _copy_or_abort(self._gpu, self._chunks, spec, [staged])
        return staged

    def _stage(self) -> StagedStore:
        """Mark this store copied and hand its buffers to a :class:`StagedStore`."""
        self._done = True
        return StagedStore(self._engine, self._pending, self._chain, self._started)

    def abort(self) -> None:
        """Release the buffers without copying anything (idempotent)."""
        self._done = True
        self._prepared = None
        release_all(self._pending)


class StoreBatch:
    """Planned stores of one engine copied together: one connector call for all of them.

    Built by :meth:`lmcache.cache_engine.LMCacheEngine.batch_stores` from stores planned with
    ``prepare=False``: their chunks laid end to end over one slot mapping (each store's slots
    from its first chunk to its last), prepared once by the connector. A serving engine's step
    saves several requests; copying them in one call costs one gather and one set of DMAs
    instead of one per request. :meth:`copy_out` returns each store's :class:`StagedStore`, to
    commit one by one; :meth:`abort` drops them all.
    """

    def __init__(
        self,
        connector: GPUConnectorInterface,
        stores: Sequence[PlannedStore],
        transfer: TransferSpec,
    ) -> None:
        for st in stores:
            if st._done or st._prepared is not None or st._gpu is not connector:
                raise ValueError(
                    "StoreBatch: every store must be planned by this engine with "
                    "plan_store(..., prepare=False) and not copied or aborted yet."
                )
        self._gpu = connector
        self._stores = list(stores)
        self._chunks: list[ChunkTransfer] = []
        parts: list[torch.Tensor] = []
        offset = 0
        for st in self._stores:
            if not st._chunks:
                continue
            lo, hi = st._chunks[0].start, st._chunks[-1].end
            parts.append(st._slots[lo:hi])
            shift = offset - lo
            self._chunks += [
                ChunkTransfer(c.start + shift, c.end + shift, c.buffer) for c in st._chunks
            ]
            offset += hi - lo
        self._slots = torch.cat(parts) if parts else transfer.slot_mapping[:0]
        spec = dataclasses.replace(transfer, slot_mapping=self._slots)
        self._prepared = connector.prepare_store(self._chunks, spec) if self._chunks else None
        self._done = False

    @property
    def num_tokens(self) -> int:
        """Tokens the stores save together."""
        return sum(c.num_tokens for c in self._chunks)

    def copy_out(self, transfer: TransferSpec) -> list[StagedStore]:
        """Copy every store's chunks out of the engine in one ``from_gpu`` call.

        Args:
            transfer: How to copy (stream, ``deferred``, ``on_engine_read``); its slot mapping
                is ignored (the batch's own is used).

        Returns:
            One staged store per planned store, in order, to ``commit()``.

        Raises:
            RuntimeError: copied or aborted already.
            Errors of the connector are raised as they are (every buffer is released).
        """
        if self._done:
            raise RuntimeError("StoreBatch.copy_out(): copied or aborted already.")
        self._done = True
        staged = [st._stage() for st in self._stores]
        if self._chunks:
            spec = dataclasses.replace(transfer, slot_mapping=self._slots, prepared=self._prepared)
            sums = _copy_or_abort(self._gpu, self._chunks, spec, staged)
            at = 0
            for st, part in zip(staged, self._stores, strict=True):
                st.sums, st.sums_at = sums, at
                at += len(part._chunks)
        return staged

    def abort(self) -> None:
        """Release every store's buffers without copying anything (idempotent)."""
        self._done = True
        self._prepared = None
        for st in self._stores:
            st.abort()


class _LayerwiseOp:
    """Shared bookkeeping of the layerwise store and retrieve objects."""

    _what = "layerwise operation"

    def __init__(
        self,
        engine: LMCacheEngine,
        connector: GPUConnectorInterface,
        pending: list[Pending],
        transfer: TransferSpec,
        started: float,
    ) -> None:
        assert isinstance(connector, SupportsLayerwise)
        self._engine = engine
        self._gpu = connector
        self._layerwise: SupportsLayerwise = connector
        self._pending = pending
        self._transfer = transfer
        self._started = started
        self._num_layers = engine.metadata.num_layers
        self._next_layer = 0
        self._checks: list[LoadChecks | None] = []  # what each load call checked
        self._done = False

    def _check_layer(self, layer: int) -> None:
        if self._done:
            raise RuntimeError(f"This {self._what} is finished or aborted; start a new one.")
        if layer != self._next_layer:
            raise ValueError(
                f"{self._what}: layers must go in order 0..{self._num_layers - 1}; expected "
                f"layer {self._next_layer}, found {layer}."
            )

    def _step(
        self,
        layer: int,
        move: Callable[[int, Sequence[ChunkTransfer], TransferSpec], LoadChecks | None],
    ) -> None:
        """Run ``move`` for ``layer`` over every chunk; a failure aborts and is raised."""
        self._check_layer(layer)
        self._advance(layer + 1, lambda chunks: move(layer, chunks, self._transfer))

    def _advance(self, stop: int, move: Callable[[list[ChunkTransfer]], Any]) -> None:
        """Run ``move`` over every chunk (layers ``next .. stop - 1``), then move on to
        ``stop``; a failure aborts and is raised. A load's checks are kept for ``finish``."""
        if self._pending:
            try:
                checks = move([p.chunk for p in self._pending])
                if isinstance(checks, LoadChecks):
                    self._checks.append(checks)
            except BaseException:
                self.abort()
                raise
        self._next_layer = stop

    def _check_complete(self) -> None:
        if self._done:
            raise RuntimeError(f"This {self._what} is finished or aborted already.")
        if self._next_layer != self._num_layers:
            done = self._next_layer
            self.abort()
            raise RuntimeError(
                f"{self._what}.finish() after {done} of {self._num_layers} layers; the transfer "
                "is incomplete and was aborted. Call it for every layer first."
            )

    def abort(self) -> None:
        """Release every buffer without completing (idempotent)."""
        self._done = True
        release_all(self._pending)


class LayerwiseStore(_LayerwiseOp):
    """A store in progress: call :meth:`store_layer` for layers ``0 .. num_layers-1``, then
    :meth:`finish` (or :meth:`abort`).

    ``chain`` is the request's chunk keys, marked used in chain order at :meth:`finish`.
    """

    _what = "LayerwiseStore"

    def __init__(
        self,
        engine: LMCacheEngine,
        connector: GPUConnectorInterface,
        pending: list[Pending],
        transfer: TransferSpec,
        started: float,
        *,
        chain: Sequence[bytes] = (),
    ) -> None:
        super().__init__(engine, connector, pending, transfer, started)
        self._chain = chain
        if pending:  # planned once for every layer (e.g. the slot indices)
            prepared = connector.prepare_store([p.chunk for p in pending], transfer)
            if prepared is not None:
                self._transfer = dataclasses.replace(transfer, prepared=prepared)

    @property
    def num_tokens(self) -> int:
        """Tokens this store saves at :meth:`finish`."""
        return sum(p.chunk.num_tokens for p in self._pending)

    def store_layer(self, layer: int) -> None:
        """Copy ``layer`` of every chunk from the engine (one ``from_gpu_layer`` call, given
        what the connector's ``prepare_store`` made of the whole store, once).

        A connector error aborts the store and is raised.
        """
        self._step(layer, self._layerwise.from_gpu_layer)

    def finish(self) -> int:
        """Make the chunks visible to lookups; returns the number of tokens stored."""
        self._check_complete()
        self._done = True
        return StagedStore(self._engine, self._pending, self._chain, self._started).commit()


class LayerwiseRetrieve(_LayerwiseOp):
    """A retrieve in progress: call :meth:`load_layer` for layers ``0 .. num_layers-1``, then
    :meth:`finish` (or :meth:`abort`).
    """

    _what = "LayerwiseRetrieve"

    def __init__(
        self,
        engine: LMCacheEngine,
        connector: GPUConnectorInterface,
        pending: list[Pending],
        transfer: TransferSpec,
        mask: torch.Tensor,
        started: float,
    ) -> None:
        super().__init__(engine, connector, pending, transfer, started)
        self._mask = mask

    @property
    def num_hit_tokens(self) -> int:
        """Tokens that will be loaded (``True`` entries of the final mask)."""
        return int(self._mask.sum())

    def load_layers(self, stop: int) -> None:
        """Copy layers ``next .. stop - 1`` of every hit chunk into the engine in one
        ``to_gpu_layers`` call (the next layers in order; ``stop`` at most ``num_layers``).

        A connector error aborts the retrieve and is raised.

        Raises:
            ValueError: ``stop`` is not after the next layer or beyond the last one.
        """
        start = self._next_layer
        if not start < stop <= self._num_layers:
            raise ValueError(
                f"{self._what}.load_layers({stop}): expected {start} < stop <= "
                f"{self._num_layers} (the next layer is {start})."
            )
        self._check_layer(start)
        layers = range(start, stop)
        self._advance(
            stop, lambda chunks: self._layerwise.to_gpu_layers(layers, chunks, self._transfer)
        )

    def load_layer(self, layer: int) -> None:
        """Copy ``layer`` of every hit chunk into the engine (one ``to_gpu_layer`` call).

        A connector error aborts the retrieve and is raised.
        """
        self._step(layer, self._layerwise.to_gpu_layer)

    def abort(self) -> None:
        """Wait for enqueued copies, then release every buffer (idempotent)."""
        if self._done:
            return
        self._done = True
        try:
            if self._pending:
                self._gpu.synchronize()
        finally:
            release_all(self._pending)

    def finish(self) -> torch.Tensor:
        """Wait for the copies and release the buffers; returns bool ``[num_tokens]``, ``True``
        for the loaded tokens.

        A chunk whose bytes did not match their checksum is not loaded: its tokens are
        ``False`` (the engine's pages may hold anything there; report them as load errors).
        """
        self._check_complete()
        if self._pending:
            try:
                self._gpu.synchronize()
                failed = self._engine._load_failures(
                    self._pending, self._checks, self._transfer.skip_tokens
                )
            except BaseException:
                self.abort()
                raise
            for i in failed:
                chunk = self._pending[i].chunk
                self._mask[chunk.start : chunk.end] = False
        self.abort()  # synchronize + release
        if self._pending:
            self._engine._count_loaded(self._pending, self._started)
        return self._mask
