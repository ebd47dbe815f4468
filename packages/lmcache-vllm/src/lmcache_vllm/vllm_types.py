# SPDX-License-Identifier: Apache-2.0
"""The parts of vLLM's objects that lmcache reads, as typing protocols.

lmcache never imports vLLM to type its code, because the lint environment has no vLLM.
These protocols name every attribute lmcache reads of vLLM's objects, so ``mypy --strict``
checks each read against them.
A vLLM release that renames one of them then needs one change here, found by a reviewer of
this module, instead of a failed request.
Attributes that some vLLM versions lack are read with ``getattr`` and a default, and are not
listed.
Members are read-only properties, so vLLM's plain attributes satisfy them.
This module imports nothing of vLLM.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Protocol

__all__ = [
    "CacheConfig",
    "CachedRequestData",
    "KVCacheConfig",
    "KVCacheGroup",
    "NewRequestData",
    "ParallelConfig",
    "SchedulerOutput",
    "SchedulerRequest",
    "VllmConfig",
]


class SchedulerRequest(Protocol):
    """vLLM's ``vllm.v1.request.Request``, as the scheduler side reads it."""

    @property
    def request_id(self) -> str: ...

    @property
    def prompt_token_ids(self) -> Sequence[int] | None: ...

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens so far."""
        ...

    @property
    def all_token_ids(self) -> Sequence[int]:
        """Prompt and output token ids so far."""
        ...


class NewRequestData(Protocol):
    """One entry of ``SchedulerOutput.scheduled_new_reqs``: a request scheduled the first time."""

    @property
    def req_id(self) -> str: ...

    @property
    def prompt_token_ids(self) -> Sequence[int] | None: ...

    @property
    def block_ids(self) -> Sequence[Sequence[int]]:
        """Block ids per KV cache group (lmcache uses group 0)."""
        ...

    @property
    def num_computed_tokens(self) -> int: ...


class CachedRequestData(Protocol):
    """``SchedulerOutput.scheduled_cached_reqs``: the requests scheduled again, column-wise."""

    @property
    def req_ids(self) -> Sequence[str]: ...

    @property
    def new_block_ids(self) -> Sequence[Sequence[Sequence[int]] | None]:
        """Per request, the new block ids per KV cache group, or ``None``."""
        ...

    @property
    def num_computed_tokens(self) -> Sequence[int]: ...


class SchedulerOutput(Protocol):
    """vLLM's ``SchedulerOutput`` (``vllm.v1.core.sched.output``), as the scheduler reads it."""

    @property
    def finished_req_ids(self) -> Collection[str]: ...

    @property
    def num_scheduled_tokens(self) -> Mapping[str, int]: ...

    @property
    def scheduled_new_reqs(self) -> Sequence[NewRequestData]: ...

    @property
    def scheduled_cached_reqs(self) -> CachedRequestData: ...


class KVCacheGroup(Protocol):
    """One of ``KVCacheConfig.kv_cache_groups``: layers that share one block table."""

    @property
    def kv_cache_spec(self) -> object: ...

    @property
    def layer_names(self) -> Sequence[str]: ...


class KVCacheConfig(Protocol):
    """vLLM's ``vllm.v1.kv_cache_interface.KVCacheConfig``, as the adapter checks it."""

    @property
    def kv_cache_groups(self) -> Sequence[KVCacheGroup]: ...


class CacheConfig(Protocol):
    """``VllmConfig.cache_config``."""

    @property
    def block_size(self) -> int:
        """Tokens per KV cache block."""
        ...


class ParallelConfig(Protocol):
    """``VllmConfig.parallel_config`` (``pipeline_parallel_size``, ``rank`` and
    ``data_parallel_rank`` are read with defaults)."""

    @property
    def tensor_parallel_size(self) -> int: ...


class VllmConfig(Protocol):
    """vLLM's ``vllm.config.VllmConfig``, as the connector's two sides read it.

    ``kv_transfer_config`` is ``None`` without a connector, so its fields are read with
    ``getattr`` and defaults.
    """

    @property
    def cache_config(self) -> CacheConfig: ...

    @property
    def parallel_config(self) -> ParallelConfig: ...

    @property
    def kv_transfer_config(self) -> object: ...
