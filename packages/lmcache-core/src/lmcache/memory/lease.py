# SPDX-License-Identifier: Apache-2.0
"""Leases: explicit, countable claims on the bytes of a host memory pool.

An allocation's bytes go back to the pool only when the last lease on them is released.
``lease.share()`` makes another lease on the same bytes, released on its own.
A released lease refuses every use with :class:`~lmcache.errors.LeaseError`.
The pool is seen only through :class:`LeaseOwner`, so this module does not import it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol

import torch

from lmcache.errors import LeaseError
from lmcache.memory.slab import Slab

__all__ = ["Allocation", "LeaseOwner", "MemoryLease", "lease_refs"]


class LeaseOwner(Protocol):
    """What a lease needs of its pool: the pool's lock, and a way to give bytes back."""

    _lock: threading.Lock

    def _free(self, alloc: Allocation) -> None:
        """Return an allocation's bytes; the caller holds ``_lock``."""


@dataclass(eq=False)
class Allocation:
    """The bytes behind one or more leases; mutated only under the pool's lock."""

    slab: Slab
    offset: int
    size: int
    view: torch.Tensor
    refs: int = 1
    checksum: int | None = None  # lmcache-mix64-sum of the bytes as written on the device


class MemoryLease:
    """A claim on an allocation of a :class:`~lmcache.memory.HostMemoryPool`.

    The allocation's bytes stay reserved while at least one lease on them is unreleased. Use a
    lease as a context manager, or call :meth:`release` exactly once. Leases are not released by
    garbage collection: a lease that is dropped without release keeps its bytes for the life of
    the pool.
    """

    __slots__ = ("_alloc", "_pool", "_released")

    def __init__(self, pool: LeaseOwner, alloc: Allocation) -> None:
        self._pool = pool
        self._alloc = alloc
        self._released = False

    def _check(self, action: str) -> None:
        if self._released:
            raise LeaseError(
                f"Cannot {action}: this MemoryLease (shape {tuple(self._alloc.view.shape)}, "
                f"{self._alloc.view.dtype}) was already released, and its bytes may now belong "
                "to another allocation. Keep the lease (or lease.share() a new one) for as long "
                "as you use the tensor."
            )

    @property
    def tensor(self) -> torch.Tensor:
        """The leased bytes as a host tensor of the shape and dtype that were allocated.

        Raises:
            LeaseError: the lease was released.
        """
        self._check("read lease.tensor")
        return self._alloc.view

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor (without alignment padding)."""
        return self._alloc.view.numel() * self._alloc.view.element_size()

    @property
    def pool_bytes(self) -> int:
        """Bytes of the pool these bytes take (:attr:`nbytes` rounded up to :data:`ALIGNMENT`):
        what releasing the last lease on them gives back."""
        return self._alloc.size

    @property
    def checksum(self) -> int | None:
        """The ``lmcache-mix64-sum`` of these bytes computed on the device that wrote them, or
        ``None``.

        Every lease on the same bytes sees the same value. The connector that loads the bytes
        back verifies it before they enter the engine's pages.
        """
        return self._alloc.checksum

    @checksum.setter
    def checksum(self, value: int | None) -> None:
        self._check("set lease.checksum")
        self._alloc.checksum = value

    @property
    def released(self) -> bool:
        """Whether this lease was released (other leases on the same bytes may remain)."""
        return self._released

    @property
    def ref_count(self) -> int:
        """Number of unreleased leases on these bytes, this one included if unreleased."""
        with self._pool._lock:
            return self._alloc.refs

    def share(self) -> MemoryLease:
        """Another lease on the same bytes, to be released independently.

        Raises:
            LeaseError: this lease was released.
        """
        with self._pool._lock:
            self._check("share()")
            self._alloc.refs += 1
            return MemoryLease(self._pool, self._alloc)

    def release(self) -> None:
        """Release this lease; the bytes return to the pool when no lease on them remains.

        Raises:
            LeaseError: this lease was released already.
        """
        with self._pool._lock:
            self._check("release() twice")
            self._released = True
            self._alloc.refs -= 1
            if self._alloc.refs == 0:
                self._pool._free(self._alloc)

    def __enter__(self) -> MemoryLease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self._released:
            self.release()

    def __repr__(self) -> str:
        state = "released" if self._released else f"refs={self._alloc.refs}"
        return (
            f"MemoryLease(shape={tuple(self._alloc.view.shape)}, dtype={self._alloc.view.dtype}, "
            f"nbytes={self.nbytes}, {state})"
        )


def lease_refs(lease: MemoryLease) -> int:
    """:attr:`MemoryLease.ref_count` without taking the lock (the caller holds it)."""
    return lease._alloc.refs
