# SPDX-License-Identifier: Apache-2.0
"""The outcome, per request, of a grouped worker's asynchronous loads.

With several KV cache groups on a vLLM that takes failed loads per request
(``KVConnectorTransferResults.failed_recving``), every load is asynchronous
(:mod:`lmcache_vllm.scheduler.async_loads`): vLLM parks the request until the workers report it.
:class:`~lmcache_vllm.worker.grouped.GroupedWorkerSide` drives each step with
:class:`AsyncLoads`:

1. ``start_load_kv`` (vLLM calls it after the step's forward is launched; the requests loading
   are not in that forward): :meth:`AsyncLoads.start` checks each load's metadata in every
   group (tokens and real blocks for the whole range). A load that fails the check is failed
   at once and no group writes any of it. Then every stream loads its group's part, with the
   machinery of a dense model's load (its leases, key reuse, device streams and checksums).
2. ``wait_for_save``: the streams finish their loads (on CUDA the host waits for the load
   stream there), so every group's outcome is known. :meth:`AsyncLoads.settle` maps each
   group's failed blocks (``get_block_ids_with_load_errors``: from the first token that did
   not arrive on) to the requests that own them. Block ids are per group, so they are mapped
   with that group's blocks only. A failed block that maps to no request fails every request
   of the step: nothing that cannot be accounted for is reported as loaded.
3. ``get_transfer_results``: :meth:`AsyncLoads.take` gives every settled request (vLLM's
   ``finished_recving``) and the failed ones (``failed_recving``). A request is reported once,
   in the step whose ``wait_for_save`` settled it: the step that loaded it, or, when vLLM
   defers ``wait_for_save`` past ``get_transfer_results`` (a draft model's forward), the next.

Loads run on vLLM's forward thread in ``start_load_kv``, not on a thread of their own: each
stream's load already overlaps the device's work on CUDA (a load stream, host waits only at
``wait_for_save``), the streams' transfer locks and leases stay as they are, and the outcome is
known at the step's end, so the request waits for one step only.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from lmcache_vllm.connector_metadata import LMCacheConnectorMetadata, ReqMeta
from lmcache_vllm.kv_groups import NULL_BLOCK, KVGroup

__all__ = ["AsyncLoads"]

logger = logging.getLogger(__name__)


@dataclass
class _Load:
    """One request's asynchronous load over every group."""

    req_id: str
    tokens: int  # what vLLM counts as loaded: [vllm_cached, load_end) of the request
    blocks: list[frozenset[int]] = field(default_factory=list)  # per group: blocks written
    why: str = ""  # why it failed ("" while it has not)


def _check(group: KVGroup, req: ReqMeta, view: ReqMeta | None) -> tuple[frozenset[int], str]:
    """The blocks ``group`` writes for ``req`` and, if its metadata cannot be loaded as
    promised, why."""
    if view is None or view.req_id != req.req_id:
        return frozenset(), f"group {group.index}: no metadata"
    load = view.load
    if load is None:  # a sliding group whose blocks before the hit's end are all null
        return frozenset(), "" if group.kind == "sliding" else f"group {group.index}: no load"
    lo, hi = load.vllm_cached, load.load_end
    if hi <= lo or hi > load.lmcache_hit or hi > len(view.token_ids):
        return frozenset(), f"group {group.index}: tokens [{lo}, {hi}) cannot be loaded"
    bs = group.block_size
    first, last = lo // bs, -(-hi // bs)
    blocks = view.block_ids[first:last]
    if len(blocks) != last - first or NULL_BLOCK in blocks:
        return frozenset(), f"group {group.index}: no block for some of tokens [{lo}, {hi})"
    return frozenset(int(b) for b in blocks), ""


class AsyncLoads:
    """The asynchronous loads of one grouped worker (see the module docstring).

    Args:
        groups: The worker's KV cache groups, in the order of its streams.
    """

    def __init__(self, groups: Sequence[KVGroup]) -> None:
        self.groups = list(groups)
        self._started: dict[str, _Load] = {}  # loaded this step, outcome not known yet
        self._settled: dict[str, _Load] = {}  # outcome known, not reported yet
        self.stats = dict.fromkeys(
            ("expected_load_tokens", "loaded_tokens", "failed_load_tokens", "num_loads"), 0
        )

    @property
    def pending(self) -> int:
        """Requests started or settled and not reported yet."""
        return len(self._started) + len(self._settled)

    def start(
        self, meta: LMCacheConnectorMetadata, views: Sequence[object], ready: bool = True
    ) -> None:
        """Note this step's loads, check each group's metadata of them, and take the loads that
        fail the check out of every group's metadata (``views``, one per group, as the streams
        read them). ``ready``: every stream can load (its KV caches are registered)."""
        for i, req in enumerate(meta.requests):
            if req.load is None:
                continue
            load = _Load(req.req_id, max(0, req.load.load_end - req.load.vllm_cached))
            for group, view in zip(self.groups, views, strict=False):
                reqs = view.requests if isinstance(view, LMCacheConnectorMetadata) else []
                blocks, why = _check(group, req, reqs[i] if i < len(reqs) else None)
                load.blocks.append(blocks)
                load.why = load.why or why
            if len(load.blocks) != len(self.groups):
                load.why = load.why or "a group has no metadata"
            if not ready:
                load.why = load.why or "KV caches not registered"
            if load.why:
                for view in views:
                    reqs = view.requests if isinstance(view, LMCacheConnectorMetadata) else []
                    if i < len(reqs) and reqs[i].load is not None:
                        reqs[i] = dataclasses.replace(reqs[i], load=None)
            earlier = self._started.get(req.req_id)
            if earlier is not None:  # loaded twice before settling: both must have worked
                load.why = load.why or earlier.why
                load.blocks = [a | b for a, b in zip(earlier.blocks, load.blocks, strict=False)]
            self._started[req.req_id] = load

    def fail(self, req_id: str, why: str) -> None:
        """This step's load of ``req_id`` failed outside the streams (a Mamba state)."""
        load = self._started.get(req_id)
        if load is not None:
            load.why = load.why or why

    def failed(self, req_id: str) -> bool:
        """Whether this step's load of ``req_id`` has failed so far."""
        load = self._started.get(req_id)
        return load is None or bool(load.why)

    def fail_started(self, why: str) -> None:
        """Every load of this step failed (a stream raised)."""
        for load in self._started.values():
            load.why = load.why or why

    def settle(self, errors: Sequence[Iterable[int]]) -> None:
        """The loads started so far are complete: ``errors[g]`` are group ``g``'s blocks whose
        load failed (each stream's ``get_block_ids_with_load_errors``)."""
        started, self._started = list(self._started.values()), {}
        for g, group_errors in enumerate(errors):
            bad = set(group_errors)
            if not bad:
                continue
            for load in started:
                hit = load.blocks[g] & bad if g < len(load.blocks) else frozenset()
                if hit:
                    load.why = load.why or f"group {g}: blocks {sorted(hit)} did not load"
                    bad -= hit
            if bad:
                logger.error(
                    "lmcache: group %d reported failed loads of blocks %s that belong to no "
                    "request loading now; failing every load of this step (%d requests)",
                    g,
                    sorted(bad),
                    len(started),
                )
                for load in started:
                    load.why = load.why or f"group {g}: unattributed failed blocks"
        for load in started:
            self.stats["num_loads"] += 1
            self.stats["expected_load_tokens"] += load.tokens
            if load.why:
                self.stats["failed_load_tokens"] += load.tokens
                logger.warning(
                    "lmcache: load of request %s failed (%s); reported to vLLM as a failed "
                    "load: it recomputes the request (kv_load_failure_policy 'recompute') or "
                    "fails it ('fail')",
                    load.req_id,
                    load.why,
                )
            else:
                self.stats["loaded_tokens"] += load.tokens
            earlier = self._settled.get(load.req_id)
            if earlier is not None:
                load.why = load.why or earlier.why
            self._settled[load.req_id] = load

    def take(self) -> tuple[set[str], set[str]]:
        """Requests settled since the last call (vLLM's ``finished_recving``) and those of them
        whose load failed (``failed_recving``)."""
        settled, self._settled = self._settled, {}
        return set(settled), {rid for rid, load in settled.items() if load.why}

    def take_stats(self) -> dict[str, float]:
        """The load counters since the last call (each request once, as vLLM uses it)."""
        out = {k: float(v) for k, v in self.stats.items()}
        self.stats = dict.fromkeys(self.stats, 0)
        return out
