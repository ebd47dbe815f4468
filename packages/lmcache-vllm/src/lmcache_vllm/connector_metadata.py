# SPDX-License-Identifier: Apache-2.0
"""Connector metadata: what the scheduler-side connector tells the workers each step.

Plain dataclasses (vLLM pickles :class:`LMCacheConnectorMetadata` to the worker processes), plus
the scheduler's per-request tracker and the worker's stats counters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = [
    "ENGINE_COUNTERS",
    "LMCacheConnectorMetadata",
    "LoadSpec",
    "ReqMeta",
    "SaveSpec",
    "StateSaves",
    "Tracker",
    "WorkerStats",
    "copied_groups",
]

try:  # the metadata must subclass vLLM's marker class; vLLM is present wherever this runs
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata as _VllmMetadata,
    )
except ImportError:  # pragma: no cover - unit tests of the pure parts without vLLM

    class _VllmMetadata:  # type: ignore[no-redef]
        pass


@dataclass
class LoadSpec:
    """What to load for a request this step.

    Attributes:
        vllm_cached: Tokens vLLM's own prefix cache holds (never written; block aligned).
        lmcache_hit: Leading tokens lmcache reported at lookup (keys are built over these).
        load_end: Load tokens ``[vllm_cached, load_end)``; ``load_end <= lmcache_hit``.
    """

    vllm_cached: int
    lmcache_hit: int
    load_end: int = 0


@dataclass
class SaveSpec:
    """Save tokens ``[skip, end)`` of the request (``skip`` is chunk aligned)."""

    skip: int
    end: int


@dataclass
class ReqMeta:
    """One request's work for this step (plain data: pickled to the workers).

    Attributes:
        req_id: vLLM's request id.
        token_ids: The request's tokens up to the end of what is loaded or saved.
        block_ids: The request's KV block ids (first KV-cache group), in token order.
        salt: Key salt derived from the request (cache salt, LoRA adapter), see
            :mod:`lmcache_vllm.scheduler.request_keys`.
        extra_keys: Per-chunk key material (multimodal item hashes), chunk index -> bytes.
        load: What to load this step, if anything.
        save: What to save this step, if anything.
        group_block_ids: With several KV cache groups (vLLM's hybrid manager), the block ids of
            every group (``block_ids`` is group 0's); ``None`` with one group.
        computed_start: Tokens the request had computed when this step was scheduled (with
            several groups: where vLLM frees a sliding window's blocks, see
            :func:`lmcache_vllm.kv_groups.group_save`).
    """

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    salt: str = ""
    extra_keys: dict[int, bytes] = field(default_factory=dict)
    load: LoadSpec | None = None
    save: SaveSpec | None = None
    group_block_ids: list[list[int]] | None = None
    computed_start: int = 0


@dataclass
class StateSaves:
    """A request's Mamba states that this step's forward writes, to be stored after it.

    Attributes:
        req_id: vLLM's request id.
        token_ids: The request's tokens up to the last boundary below.
        salt: Key salt of the request, as in :class:`ReqMeta`.
        extra_keys: Per-chunk key material, as in :class:`ReqMeta`.
        states: ``(group, block_id, boundary)`` as vLLM offers them: the state after
            ``boundary`` tokens, in block ``block_id`` of KV cache group ``group``.
    """

    req_id: str
    token_ids: list[int]
    salt: str = ""
    extra_keys: dict[int, bytes] = field(default_factory=dict)
    states: list[tuple[int, int, int]] = field(default_factory=list)


@dataclass
class LMCacheConnectorMetadata(_VllmMetadata):  # type: ignore[misc]
    """Per-step metadata from the scheduler-side connector to the workers.

    Attributes:
        requests: Loads and saves of this step.
        preempted: Requests vLLM preempted since the last step: their blocks are about to be
            reused, so the workers finish reading them (in-flight saves) first.
        finished: Saves of requests that finished at the last step with chunks completed by
            speculative tokens vLLM accepted in that step (known only after it). vLLM has freed
            their blocks: the workers copy them in ``handle_preemptions``, before anything of
            this step rewrites a page, or not at all.
        state_saves: Mamba states this step writes (:mod:`lmcache_vllm.worker.mamba_states`).
    """

    requests: list[ReqMeta] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    finished: list[ReqMeta] = field(default_factory=list)
    state_saves: list[StateSaves] = field(default_factory=list)


@dataclass
class Tracker:
    """Scheduler-side state of a running request."""

    req_id: str
    prompt_len: int
    block_ids: list[int]
    salt: str
    num_saved: int  # tokens known stored (chunk aligned)
    extra_keys: dict[int, bytes] = field(default_factory=dict)
    group_block_ids: list[list[int]] | None = None  # every group's, with several groups
    computed_end: int = 0  # tokens computed once the request's last scheduled step ran

    def computed(self, start: int, end: int, chunk_size: int, resumed: bool = False) -> None:
        """A step computes tokens ``[start, end)``.

        A running request's start below its last step's end is a rollback: vLLM recomputes
        from ``start``.
        A failed load rolls a request back, and the workers stored no chunk computed over it
        (:mod:`lmcache_vllm.worker.failed_loads`).
        So the chunks from ``start``'s chunk on count as unsaved again, and the recompute saves
        them.
        A resumed (preempted) request computes again what vLLM freed: what it stored stays
        stored.
        """
        if start < self.computed_end and not resumed:
            self.num_saved = min(self.num_saved, start // chunk_size * chunk_size)
        self.computed_end = end

    def take_blocks(self, new_blocks: Sequence[Sequence[int]] | None, resumed: bool) -> None:
        """A step's new blocks per group: appended, or, for a resumed (preempted) request,
        its whole new block table."""
        if resumed:
            self.block_ids = list(new_blocks[0]) if new_blocks else []
        elif new_blocks:
            self.block_ids.extend(new_blocks[0])
        per_group = self.group_block_ids
        if per_group is None:
            return
        if resumed:
            self.group_block_ids = [list(b) for b in new_blocks] if new_blocks else []
        elif new_blocks:
            for blocks, new_ids in zip(per_group, new_blocks, strict=True):
                blocks.extend(new_ids)


def copied_groups(per_group: Sequence[Sequence[int]] | None) -> list[list[int]] | None:
    """A copy of every KV cache group's block ids (``None`` with one group)."""
    return [[int(b) for b in blocks] for blocks in per_group] if per_group is not None else None


ENGINE_COUNTERS: tuple[str, ...] = (
    "checksum_failures",
    "tier_errors",
    "tier_timeouts",
    "disk_hit_chunks",
    "remote_hit_chunks",
    "dropped_writes",
)
"""Counters of the worker's :class:`~lmcache.metrics.LMCacheMetrics` reported in the connector
stats (as deltas), named as there."""


@dataclass
class WorkerStats:
    """Worker-side counters since the last :meth:`LMCacheConnectorV1Impl.take_stats`."""

    loaded_tokens: int = 0
    expected_load_tokens: int = 0
    failed_load_tokens: int = 0
    stored_tokens: int = 0
    load_seconds: float = 0.0
    save_seconds: float = 0.0
    loaded_bytes: int = 0
    stored_bytes: int = 0
    num_loads: int = 0
    num_saves: int = 0
    expired_leases: int = 0

    def as_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.__dict__.items()}
