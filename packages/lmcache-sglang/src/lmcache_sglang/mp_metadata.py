# SPDX-License-Identifier: Apache-2.0
"""Plain data of SGLang's ``--enable-lmcache`` flow (SGLang 0.5.21+).

SGLang's ``LMCacheUnifiedRadixCache`` imports :class:`LMCacheExternalFlow` and
:class:`LMCachePendingStore` from ``lmcache.integration.sglang.lmcache_mp_metadata`` and reads and
writes their fields itself; the operation objects (:class:`LookupOp`, :class:`LoadOp`,
:class:`StoreOp`) are what :class:`~lmcache_sglang.mp_connector.UnifiedLMCacheMPConnector`
hands back from its ``submit_*`` calls. This module never imports SGLang or torch at runtime.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from lmcache.cache_engine import HeldHit

__all__ = ["LMCacheExternalFlow", "LMCachePendingStore", "LoadOp", "LookupOp", "StoreOp"]


def _done(value: Any) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future


@dataclass(eq=False)
class LookupOp:
    """A submitted lookup: ``future`` gives the stored prefix in tokens (0 on a miss).

    Attributes:
        request_id: SGLang's request id.
        token_ids: The request's page-aligned tokens.
        salt: lmcache salt of the request (SGLang's ``extra_key`` and ``cache_salt``).
        local_hit_tokens: Tokens SGLang's device cache held at lookup time.
        lock_start: First token whose chunk the lookup holds (always 0: one hold per lookup).
        held: Leases on the hit chunks until the load completes or the locks are freed.
    """

    request_id: str
    token_ids: list[int]
    salt: str
    local_hit_tokens: int
    future: Future[Any] = field(default_factory=lambda: _done(0))
    held: HeldHit | None = None
    lock_start: int = 0

    @property
    def total_hit(self) -> int:
        return int(self.future.result()) if self.future.done() else 0

    def release(self) -> None:
        """Release the held chunks (idempotent)."""
        if self.held is not None and not self.held.released:
            self.held.release()


@dataclass(eq=False)
class LoadOp:
    """A submitted load into ``device_indices`` (the tokens after ``local_hit_tokens``)."""

    request_id: str
    device_indices: torch.Tensor
    local_hit_tokens: int
    future: Future[Any]
    lookup: LookupOp | None = None

    @property
    def result(self) -> bool:
        """Whether every requested token landed (``False`` while pending or on failure)."""
        return bool(self.future.done() and self.future.exception() is None and self.future.result())


@dataclass(eq=False)
class StoreOp:
    """A submitted store; ``future`` gives the tokens newly stored."""

    request_id: str
    num_tokens: int
    future: Future[Any]


@dataclass(eq=False)
class LMCacheExternalFlow:
    """SGLang's per-request state of an lmcache lookup and load (fields SGLang reads/writes)."""

    key: Any
    lookup: LookupOp
    total_hit: int | None = None
    local_hit_tokens: int | None = None
    load: LoadOp | None = None
    load_completed: bool = False
    cancelled: bool = False
    retire_requested: bool = False
    prefix_published: bool = False
    loaded_skip_tokens: int = 0
    released_skip_tokens: int = 0
    mamba_value: Any = None
    request_mamba_value: Any = None
    allocated_request_mamba_for_load: bool = False
    free_mamba_after_load: bool = False
    load_req: Any = None
    anchor_node: Any = None
    anchor_lock: Any = None


@dataclass(eq=False)
class LMCachePendingStore:
    """A store SGLang waits for, with the tree node it keeps locked until then."""

    operation: StoreOp
    node_id: Any
    lock_params: Any
