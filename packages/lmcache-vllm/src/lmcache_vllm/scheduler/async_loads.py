# SPDX-License-Identifier: Apache-2.0
"""Asynchronous loads for a KV cache of several groups: a failed load recomputes its request.

With several KV cache groups (vLLM's hybrid KV cache manager) block ids are per group, and vLLM
cannot take block-level load errors (``get_block_ids_with_load_errors``): it raises. A vLLM that
has ``KVConnectorTransferResults.failed_recving`` takes failures per request instead, but only
for asynchronous loads (a request in ``WAITING_FOR_REMOTE_KVS``). So with several groups on such
a vLLM every hit is loaded asynchronously:

1. :meth:`AsyncLoadsSchedulerSide.get_num_new_matched_tokens` reports the hit as usual; the
   connector adds ``load_async=True`` (:attr:`AsyncLoadsSchedulerSide.loads_async`). vLLM
   allocates the request's blocks and parks it in ``WAITING_FOR_REMOTE_KVS``.
2. :meth:`AsyncLoadsSchedulerSide.update_state_after_alloc` builds the load from the blocks vLLM
   just allocated (every group's), and the step's metadata carries it to the workers. vLLM
   now waits for a worker report on this request, so a load is always sent, whatever fails
   here: one that cannot be built is sent empty, and the workers report it failed.
3. The workers load every group's part in that step and report the request in
   ``finished_recving``, and in ``failed_recving`` when any group's load of it failed or was
   short (:mod:`lmcache_vllm.worker.async_loads`).
4. vLLM then schedules the request: from the hit on, or, after a failure, from token 0 with
   ``kv_load_failure_policy="recompute"`` (with ``"fail"``, vLLM ends the request with an
   error). :meth:`AsyncLoadsSchedulerSide.update_connector_output` notes the failure: a later
   lookup of that request is a miss, so its recompute never waits on lmcache again.

A request whose load succeeded counts its hit as stored: the save of its first scheduled step
starts after the hit, as for a synchronous load.

A Mamba model's states (vLLM's Mamba prefix-caching mode) are saved from vLLM's offers: each
step's metadata carries the states that step's forward writes, at boundaries where hits may end
(:meth:`AsyncLoadsSchedulerSide.state_saves`, stored by
:mod:`lmcache_vllm.worker.mamba_states`).

A dense model (one group) never comes here: its loads stay synchronous, errors per block.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from functools import partial

from lmcache.config import LMCacheConfig
from lmcache_vllm.connector_metadata import (
    LMCacheConnectorMetadata,
    LoadSpec,
    ReqMeta,
    SaveSpec,
    StateSaves,
    Tracker,
)
from lmcache_vllm.kv_groups import kv_groups, state_alignment
from lmcache_vllm.scheduler.request_keys import chunk_extra_keys
from lmcache_vllm.scheduler.side import SchedulerSide
from lmcache_vllm.vllm_types import SchedulerOutput, SchedulerRequest, VllmConfig

__all__ = ["NO_FAILED_RECVING", "AsyncLoadsSchedulerSide", "block_ids_of"]

logger = logging.getLogger(__name__)

NO_FAILED_RECVING = (
    "lmcache: this model's KV cache has %d groups (vLLM's hybrid KV cache manager), and this "
    "vLLM cannot be told per request that a load failed (it has no "
    "KVConnectorTransferResults.failed_recving; its block-level load errors do not work with "
    "several groups). So that a failed load can never leave a request with KV that was not "
    "loaded, lmcache loads nothing for this engine and only stores: every prompt is computed. "
    "A vLLM with failed_recving (0.32 and later) gets hits."
)
"""Logged once at start-up by the scheduler side of an engine in that case (``%d``: groups)."""

MAMBA_RETENTION = (
    "lmcache: hits of this Mamba model end on multiples of %d tokens (chunk_size and the block "
    "sizes), and vLLM keeps Mamba states only at multiples of --prefix-cache-retention-interval "
    "(%s; 0 keeps only each prompt's last block boundary): most prompts will get no hit from "
    "lmcache. Start vLLM with --prefix-cache-retention-interval set to a multiple of %d (each "
    "state kept holds every Mamba layer's state: a larger interval keeps fewer)."
)
"""Logged once at start-up when vLLM's retained Mamba states miss lmcache's hit boundaries."""


def block_ids_of(blocks: object) -> list[list[int]]:
    """Every group's block ids of vLLM's ``KVCacheBlocks`` (``get_block_ids()``)."""
    get = getattr(blocks, "get_block_ids", None)
    if get is None:
        raise TypeError(f"lmcache: no block ids in {type(blocks).__name__}")
    return [[int(b) for b in group] for group in get()]


def _unloadable(rid: str, num_tokens: int) -> ReqMeta:
    """A load the workers cannot perform (no tokens, no blocks): they report it failed."""
    return ReqMeta(req_id=rid, token_ids=[], block_ids=[], load=LoadSpec(0, 0, num_tokens))


class AsyncLoadsSchedulerSide(SchedulerSide):
    """:class:`SchedulerSide` whose loads are asynchronous (see the module docstring).

    Args: As for :class:`SchedulerSide`.
    """

    loads_async = True

    def __init__(
        self,
        vllm_config: VllmConfig,
        config: LMCacheConfig,
        world_size: int,
        local_world_size: int,
        kv_cache_config: object = None,
    ) -> None:
        super().__init__(vllm_config, config, world_size, local_world_size, kv_cache_config)
        self._owed: dict[str, ReqMeta] = {}  # loads for the next step's metadata
        self._hit_saved: dict[str, int] = {}  # tokens an async load stores for its request
        self._failed_loads: set[str] = set()  # requests whose async load failed: no more hits
        self.state_step = state_alignment(self.hit_align, self.chunk_size)
        mamba = any(g.kind == "mamba" for g in kv_groups(kv_cache_config, self.block_size))
        retention = getattr(vllm_config.cache_config, "prefix_cache_retention_interval", 0)
        step = self.state_step  # hits need a state there; vLLM keeps multiples of retention
        sparse = retention is not None and (
            retention == 0 or (retention % step and step % retention)
        )
        if mamba and not self.inert and sparse:  # retention None: vLLM keeps every state
            logger.warning(MAMBA_RETENTION, self.state_step, retention, self.state_step)

    # ------------------------------------------------------------------ vLLM entry points

    def get_num_new_matched_tokens(
        self, request: SchedulerRequest, num_computed_tokens: int
    ) -> int | None:
        """As :meth:`SchedulerSide.get_num_new_matched_tokens`; ``0`` for a request whose load
        failed (vLLM recomputes it from token 0: asking again could fail the same way)."""
        rid = str(getattr(request, "request_id", "?"))
        if rid in self._failed_loads:
            self._load_specs.pop(rid, None)
            return 0
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: SchedulerRequest, num_external_tokens: int, blocks: object = None
    ) -> None:
        """Build the load of an accepted hit from vLLM's blocks (``KVCacheBlocks``), for the
        next :meth:`build_connector_meta`. vLLM waits for it: it is built before anything
        else, and sent unloadable (reported failed) when building fails."""
        rid = str(getattr(request, "request_id", "?"))
        spec = self._load_specs.pop(rid, None)  # never reaches the synchronous path
        if num_external_tokens > 0:
            self._owed[rid] = _unloadable(rid, num_external_tokens)
            self._owed[rid] = self._guard(
                "update_state_after_alloc",
                rid,
                self._owed[rid],
                lambda: self._load(request, rid, spec, num_external_tokens, blocks),
            )
        super().update_state_after_alloc(request, 0)

    def _load(
        self,
        request: SchedulerRequest,
        rid: str,
        spec: LoadSpec | None,
        num_external_tokens: int,
        blocks: object,
    ) -> ReqMeta:
        if spec is None:
            raise RuntimeError("vLLM accepted a hit that lmcache did not report")
        load = LoadSpec(spec.vllm_cached, spec.lmcache_hit, spec.vllm_cached + num_external_tokens)
        if load.load_end > load.lmcache_hit:
            raise RuntimeError(f"vLLM accepted {num_external_tokens} tokens beyond the hit")
        per_group = block_ids_of(blocks)
        key = self._key(request)
        prompt = request.prompt_token_ids or []
        tokens = [int(t) for t in prompt[: load.lmcache_hit]]
        self._hit_saved[rid] = load.lmcache_hit // self.chunk_size * self.chunk_size
        return ReqMeta(
            req_id=rid,
            token_ids=tokens,
            block_ids=list(per_group[0]) if per_group else [],
            salt=key.salt,
            extra_keys=chunk_extra_keys(key.extra_keys, len(tokens), self.chunk_size),
            load=load,
            group_block_ids=per_group,
            computed_start=load.vllm_cached,
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> LMCacheConnectorMetadata:
        """The step's metadata, with the loads of the hits vLLM accepted this step (their
        requests are not scheduled: vLLM waits for the workers' report)."""
        meta = super().build_connector_meta(scheduler_output)
        owed, self._owed = self._owed, {}
        meta.requests.extend(owed.values())
        meta.state_saves = self.state_saves(scheduler_output)
        return meta

    def state_saves(self, scheduler_output: SchedulerOutput) -> list[StateSaves]:
        """The Mamba states vLLM offers in this step (``boundary_state_offloads``: the step's
        forward writes them), at boundaries where hits may end and within the tokens saved."""
        if self.inert or self.kv_role == "kv_consumer":
            return []
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        offers = getattr(block_state, "boundary_state_offloads", None) or {}
        out: list[StateSaves] = []
        for rid, states in offers.items():
            offered = partial(self._offered, out, str(rid), states)
            self._guard("build_connector_meta", str(rid), None, offered)
        return out

    def _offered(self, out: list[StateSaves], rid: str, states: Sequence[Sequence[int]]) -> None:
        request, tracker = self._requests.get(rid), self._trackers.get(rid)
        if request is None or tracker is None:
            return  # not cached (a skipped request) or unknown
        known = len(request.all_token_ids)
        limit = known if self.config.save_decode_cache else min(known, tracker.prompt_len)
        keep = [
            (int(g), int(block), int(n))
            for g, block, n in states
            if 0 < int(n) <= limit and int(n) % self.state_step == 0
        ]
        if keep:
            top = max(n for *_, n in keep)
            extra = chunk_extra_keys(tracker.extra_keys, top, self.chunk_size)
            tokens = list(request.all_token_ids[:top])
            out.append(StateSaves(rid, tokens, tracker.salt, extra, keep))

    def update_connector_output(
        self, finished_recving: Collection[str], failed_recving: Collection[str]
    ) -> None:
        """The workers' report (``KVConnectorOutput``): a failed load's request is recomputed
        from token 0 and stores every chunk again (the bad one too), and is not looked up
        again."""
        for rid in failed_recving:
            self._hit_saved.pop(rid, None)
            if rid in self._requests or rid in self._keys:
                self._failed_loads.add(rid)
                logger.debug("lmcache: load of request %s failed; vLLM recomputes it", rid)

    # ------------------------------------------------------------------ hooks of SchedulerSide

    def _save_spec(self, tracker: Tracker, computed_end: int) -> SaveSpec | None:
        """A request whose async load succeeded holds its hit already: saves start after it."""
        stored = self._hit_saved.pop(tracker.req_id, None)
        if stored is not None and tracker.req_id not in self._failed_loads:
            tracker.num_saved = max(tracker.num_saved, stored)
        return super()._save_spec(tracker, computed_end)

    def _forget(self, rid: str) -> Tracker | None:
        # an owed load stays: vLLM holds an aborted request's blocks until the workers report it
        self._hit_saved.pop(rid, None)
        self._failed_loads.discard(rid)
        return super()._forget(rid)
