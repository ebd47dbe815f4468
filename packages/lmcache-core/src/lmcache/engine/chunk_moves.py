# SPDX-License-Identifier: Apache-2.0
"""Chunks in transit, and what the objects that move them need from the engine.

A :class:`Pending` is one chunk that a store or retrieve is moving. It holds the chunk's key,
the connector's view of it and the lease on its host buffer. The store objects
(:mod:`lmcache.engine.store_plan`) and the layerwise objects (:mod:`lmcache.engine.layerwise`)
reach the engine only through the two protocols here. :class:`StoreCommitter` publishes the chunks of a
finished store. :class:`LoadFinisher` checks and counts the chunks of a finished load. The
engine passes in objects that implement them, so these modules never import the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from lmcache.gpu_connector.checksums import LoadChecks
from lmcache.gpu_connector.interface import ChunkTransfer
from lmcache.memory import MemoryLease

__all__ = ["LoadFinisher", "Pending", "StoreCommitter", "release_all", "unmark"]


@dataclass(frozen=True)
class Pending:
    """A chunk being moved: its key, the connector's view of it, and the lease on its buffer.

    ``parent`` is the previous chunk's key in the request's chain (``None`` for chunk 0).
    A store records it in the tiers for their eviction order.
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


def unmark(mask: torch.Tensor, pending: Sequence[Pending], positions: Sequence[int]) -> None:
    """Set ``mask`` ``False`` over the tokens of ``pending[i]`` for each ``i`` in ``positions``
    (chunks that were not loaded)."""
    for i in positions:
        chunk = pending[i].chunk
        mask[chunk.start : chunk.end] = False


class StoreCommitter(Protocol):
    """Publishes the filled buffers of a store (:class:`lmcache.engine.stores.StoreWriter`)."""

    def commit_store(
        self,
        pending: Sequence[Pending],
        started: float,
        chain: Sequence[bytes] = (),
        sums: Sequence[int] | None = None,
    ) -> int:
        """Hand the chunks to the tiers and return the number of tokens stored.

        ``sums`` are the chunks' checksums computed on the device, if any. ``chain`` is the
        request's keys, marked used in chain order. ``started`` is when the store began.
        """
        ...


class LoadFinisher(Protocol):
    """Checks and counts the chunks of a completed load (:class:`lmcache.engine.load_checks.LoadChecker`)."""

    def load_failures(
        self, pending: Sequence[Pending], checks: Sequence[LoadChecks | None], skip_tokens: int
    ) -> list[int]:
        """Positions of the loaded chunks whose bytes did not match their checksum."""
        ...

    def count_loaded(self, pending: Sequence[Pending], started: float) -> None:
        """Count the loaded chunks, their bytes and the time since ``started``."""
        ...
