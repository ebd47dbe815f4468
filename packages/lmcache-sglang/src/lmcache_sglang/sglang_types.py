# SPDX-License-Identifier: Apache-2.0
"""The parts of SGLang's objects that lmcache-sglang reads, as typing protocols.

SGLang is not imported for typing: its classes change between releases, and the lint session does
not install it.
Each protocol names only the attributes and methods we read directly, so ``mypy --strict`` checks
every such read.
Attributes that only some SGLang versions have are read with ``getattr`` and a default, and are
left out here; an object read only that way is typed ``object``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeAlias

import torch

__all__ = ["CacheInitParams", "HostKVPool", "KVPoolAllocator", "TokenIds"]

TokenIds: TypeAlias = Sequence[int] | torch.Tensor
"""A request's token ids as SGLang hands them over: a list of ints or a 1-D tensor."""


class KVPoolAllocator(Protocol):
    """SGLang's ``TokenToKVPoolAllocator`` (``BaseTokenToKVPoolAllocator``)."""

    def get_kvcache(self) -> object:
        """The device KV pool (``MHATokenToKVPool``, ``MLATokenToKVPool``, ...), read by attribute
        in :func:`lmcache_sglang.kv_pools.device_pool_layers`."""
        ...


class CacheInitParams(Protocol):
    """SGLang's ``CacheInitParams``, as the unified cache linker receives it."""

    @property
    def page_size(self) -> int:
        """Tokens per page of the device KV pool."""
        ...

    @property
    def token_to_kv_pool_allocator(self) -> KVPoolAllocator:
        """The allocator that owns the device KV pool."""
        ...


class HostKVPool(Protocol):
    """A HiCache host pool (``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost``)."""

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        ...

    @property
    def layer_num(self) -> int:
        """Layers held per token."""
        ...

    @property
    def layout(self) -> str:
        """``layer_first``, ``page_first`` or ``page_first_direct`` (``--hicache-mem-layout``)."""
        ...

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        """A new flat page buffer, for a ``get`` without a target."""
        ...
