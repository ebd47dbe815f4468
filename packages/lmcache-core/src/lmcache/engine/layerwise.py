# SPDX-License-Identifier: Apache-2.0
"""Layerwise store and retrieve: one connector call per layer, to overlap with the forward pass.

:meth:`lmcache.cache_engine.LMCacheEngine.store_layerwise` and
:meth:`~lmcache.cache_engine.LMCacheEngine.retrieve_layerwise` plan the request (keys, leases).
They return one of these plain objects. The caller drives it layer by layer, in order, then
calls ``finish()`` (or ``abort()``). Chunks of a layerwise store become visible to lookups at
``finish()``. A layerwise retrieve keeps its chunk leases until the copies are done. These
objects reach the engine only through the protocols of :mod:`lmcache.engine.chunk_moves`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lmcache.engine.chunk_moves import (
    LoadFinisher,
    Pending,
    StoreCommitter,
    release_all,
    unmark,
)
from lmcache.engine.store_plan import StagedStore
from lmcache.gpu_connector.checksums import LoadChecks, StoreChecksums
from lmcache.gpu_connector.interface import (
    ChunkTransfer,
    GPUConnectorInterface,
    SupportsLayerwise,
    TransferSpec,
)
from lmcache.gpu_ops.mix64sum import signed64

__all__ = ["LayerwiseRetrieve", "LayerwiseStore"]


class _LayerwiseOp:
    """Shared bookkeeping of the layerwise store and retrieve objects."""

    _what = "layerwise operation"

    def __init__(
        self,
        connector: GPUConnectorInterface,
        pending: list[Pending],
        transfer: TransferSpec,
        started: float,
        num_layers: int,
    ) -> None:
        assert isinstance(connector, SupportsLayerwise)
        self._gpu = connector
        self._layerwise: SupportsLayerwise = connector
        self._pending = pending
        self._transfer = transfer
        self._started = started
        self._num_layers = num_layers
        self._next_layer = 0
        self._checks: list[LoadChecks | None] = []  # what each load call checked
        self._store_sums: list[StoreChecksums] = []  # each store call's sums of its layer
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
        move: Callable[
            [int, Sequence[ChunkTransfer], TransferSpec], LoadChecks | StoreChecksums | None
        ],
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
                elif isinstance(checks, StoreChecksums):
                    self._store_sums.append(checks)
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

    ``committer`` publishes the chunks at :meth:`finish`. ``chain`` is the request's chunk keys,
    marked used in chain order then.
    """

    _what = "LayerwiseStore"

    def __init__(
        self,
        committer: StoreCommitter,
        connector: GPUConnectorInterface,
        pending: list[Pending],
        transfer: TransferSpec,
        started: float,
        *,
        num_layers: int,
        chain: Sequence[bytes] = (),
    ) -> None:
        super().__init__(connector, pending, transfer, started, num_layers)
        self._committer = committer
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
        """Make the chunks visible to lookups; returns the number of tokens stored.

        When the connector summed every layer on the device, the layers' sums add up to each
        chunk's checksum and the chunks are not hashed on the host. Call this once the copies
        are complete (the sums are read here).
        """
        self._check_complete()
        self._done = True
        sums = None
        if self._pending and len(self._store_sums) == self._num_layers:
            layers = [s.values() for s in self._store_sums]
            totals = [sum(parts) % (1 << 64) for parts in zip(*layers, strict=True)]
            sums = StoreChecksums(torch.tensor([signed64(t) for t in totals], dtype=torch.int64))
        return StagedStore(
            self._committer, self._pending, self._chain, self._started, sums
        ).commit()


class LayerwiseRetrieve(_LayerwiseOp):
    """A retrieve in progress: call :meth:`load_layer` for layers ``0 .. num_layers-1``, then
    :meth:`finish` (or :meth:`abort`).

    ``finisher`` checks the loaded chunks' checksums and counts them at :meth:`finish`.
    """

    _what = "LayerwiseRetrieve"

    def __init__(
        self,
        finisher: LoadFinisher,
        connector: GPUConnectorInterface,
        pending: list[Pending],
        transfer: TransferSpec,
        mask: torch.Tensor,
        started: float,
        *,
        num_layers: int,
    ) -> None:
        super().__init__(connector, pending, transfer, started, num_layers)
        self._finisher = finisher
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
                failed = self._finisher.load_failures(
                    self._pending, self._checks, self._transfer.skip_tokens
                )
            except BaseException:
                self.abort()
                raise
            unmark(self._mask, self._pending, failed)
        self.abort()  # synchronize + release
        if self._pending:
            self._finisher.count_loaded(self._pending, self._started)
        return self._mask
