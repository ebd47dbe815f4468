# SPDX-License-Identifier: Apache-2.0
"""A batched store split in steps: planned, then copied, then committed.

:meth:`lmcache.cache_engine.LMCacheEngine.plan_store` returns a :class:`PlannedStore`.
It holds the keys, the leases and the connector's planning, made before the engine has
computed the KV. Its ``copy_out()`` returns a :class:`StagedStore`: the bytes are copied, not yet
visible. Its ``commit()`` publishes them. :class:`StoreBatch` copies several planned stores in
one connector call. These objects reach the engine only through a
:class:`~lmcache.engine.chunk_moves.StoreCommitter`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from lmcache.engine.chunk_moves import Pending, StoreCommitter, release_all
from lmcache.gpu_connector.checksums import StoreChecksums
from lmcache.gpu_connector.interface import ChunkTransfer, GPUConnectorInterface, TransferSpec

__all__ = ["PlannedStore", "StagedStore", "StoreBatch"]


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
        committer: StoreCommitter,
        pending: list[Pending],
        chain: Sequence[bytes],
        started: float,
        sums: StoreChecksums | None = None,
        sums_at: int = 0,
    ) -> None:
        self._committer = committer
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
            return self._committer.commit_store(self._pending, self._started, self._chain, sums)
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
        committer: StoreCommitter,
        connector: GPUConnectorInterface,
        pending: list[Pending],
        chain: Sequence[bytes],
        transfer: TransferSpec,
        started: float,
        *,
        prepare: bool = True,
    ) -> None:
        self._committer = committer
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
        return StagedStore(self._committer, self._pending, self._chain, self._started)

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
