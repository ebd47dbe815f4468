# SPDX-License-Identifier: Apache-2.0
"""Scheduler side of the lmcache connector: what to load and save for each request.

vLLM calls these from its scheduler loop, so nothing here may raise into vLLM. Every entry point
turns an lmcache-side failure into a miss for that request: a hostile request field, a worker
that does not answer, a bug. Each kind of failure is logged once and counted
(``scheduler_failures`` in the connector stats).

Per request:

1. :meth:`SchedulerSide.get_num_new_matched_tokens` derives the request's key material
   (:mod:`lmcache_vllm.scheduler.request_keys`). It asks every worker rank in parallel how many
   leading prompt tokens lmcache holds (:mod:`lmcache_vllm.scheduler.lookup_client`). Each rank
   *leases* the chunks it found, so they cannot be evicted before the load. The method reports
   the tokens beyond vLLM's own prefix-cache hit. The hit ends on a block boundary before the
   last prompt token, as vLLM's own hits do. When vLLM's hit already reaches that point, no rank
   is asked.
2. :meth:`SchedulerSide.update_state_after_alloc` and :meth:`SchedulerSide.build_connector_meta`
   record what to load (``[vllm_cached, load_end)``) and what to save. Plain dataclasses carry
   both to the workers. A save never goes beyond the request's known tokens: with speculative
   decoding, a chunk that drafts complete is saved at the next step, once they are accepted.
3. :meth:`SchedulerSide.request_finished` forgets the request. vLLM frees its blocks at once.
   Every worker step first waits until queued saves have copied their pages
   (:mod:`lmcache_vllm.worker.save_queue`), so a freed block is never rewritten under a save.

Some lookups take longer than a scheduler step: with a disk or remote tier, and on CUDA with
checksums, where the worker checks the hit on the GPU before it answers. Those run on a thread
pool (:mod:`lmcache_vllm.scheduler.prefix_lookups`). The method then returns ``None``, vLLM's
"ask again later", until the answer is in. Such a lookup has a deadline
(:data:`~lmcache_vllm.scheduler.prefix_lookups.ASYNC_LOOKUP_TIMEOUT_S`); past it, it is a miss,
counted in ``lookup_timeouts``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from functools import partial

from lmcache.config import LMCacheConfig
from lmcache_vllm.connector_metadata import (
    LMCacheConnectorMetadata,
    LoadSpec,
    ReqMeta,
    SaveSpec,
    Tracker,
    copied_groups,
)
from lmcache_vllm.kv_groups import (
    UNSUPPORTED_GROUPS,
    hit_alignment,
    kv_groups,
    mamba_states_off,
    unsupported_kinds,
)
from lmcache_vllm.lookup_sockets import engine_key
from lmcache_vllm.lookup_wire import LookupQuery
from lmcache_vllm.scheduler.guard import GuardedHooks
from lmcache_vllm.scheduler.prefix_lookups import (
    SEVERAL_NODES,
    PrefixLookups,
    runs_off_thread,
)
from lmcache_vllm.scheduler.request_keys import (
    RequestKey,
    RequestKeyer,
    chunk_extra_keys,
    skips_reading,
)
from lmcache_vllm.vllm_types import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
    SchedulerRequest,
    VllmConfig,
)

__all__ = ["SchedulerSide"]

logger = logging.getLogger(__name__)


class SchedulerSide(GuardedHooks):
    """Scheduler-side state of the lmcache connector (see the module docstring).

    Args:
        vllm_config: vLLM's ``VllmConfig``.
        config: lmcache configuration.
        world_size: Worker ranks holding shards (tensor x pipeline parallel).
        local_world_size: Ranks on this node; when smaller than ``world_size`` lookups cannot
            reach every rank and nothing is loaded (said once at start-up).
        kv_cache_config: vLLM's ``KVCacheConfig``: with several groups (the hybrid manager),
            every group's blocks are tracked, and hits end where :mod:`lmcache_vllm.kv_groups`
            says; a group lmcache cannot store turns the connector off for the engine.
    """

    loads_async = False  # several groups: hits load asynchronously (AsyncLoadsSchedulerSide)

    def __init__(
        self,
        vllm_config: VllmConfig,
        config: LMCacheConfig,
        world_size: int,
        local_world_size: int,
        kv_cache_config: object = None,
    ) -> None:
        super().__init__()
        ktc = vllm_config.kv_transfer_config
        self.kv_role: str = getattr(ktc, "kv_role", None) or "kv_both"
        self.config = config
        self.chunk_size = config.chunk_size
        self.block_size = int(vllm_config.cache_config.block_size)
        self.engine_key = engine_key(vllm_config)
        self.world_size = world_size
        self._keyer = RequestKeyer(self.chunk_size)
        device = getattr(getattr(vllm_config, "device_config", None), "device_type", None)
        self.async_lookups = runs_off_thread(device, config)
        self.lookups = PrefixLookups(self.engine_key, world_size, self.async_lookups)
        self._load_specs: dict[str, LoadSpec] = {}
        self._trackers: dict[str, Tracker] = {}
        self._requests: dict[str, SchedulerRequest] = {}
        self._keys: dict[str, RequestKey] = {}
        self._preempted: list[str] = []
        self._finished_saves: list[ReqMeta] = []  # sent with the next step's metadata
        self._client_timeouts = 0  # the lookup client's timeouts already reported
        self._late_lookups = 0  # the lookups' late misses already reported
        self.loads_enabled = self.kv_role != "kv_producer"
        groups = kv_groups(kv_cache_config, self.block_size)
        self.multi_group = len(groups) > 1
        self.hit_align = hit_alignment(groups, self.chunk_size, self.block_size)
        mamba_off = mamba_states_off(vllm_config, self.loads_async)
        unsupported = unsupported_kinds(groups, not mamba_off) if self.multi_group else []
        self.inert = bool(unsupported)  # lmcache stores and loads nothing for this engine
        if self.inert:
            self.loads_enabled = False
            why = mamba_off if "mamba" in unsupported else ""
            logger.warning(UNSUPPORTED_GROUPS, ", ".join(unsupported), why)
        if world_size > local_world_size:
            self.loads_enabled = False
            logger.warning(SEVERAL_NODES, world_size, local_world_size)

    def _on_failure(self, request_id: str) -> None:
        self._load_specs.pop(request_id, None)

    def _key(self, request: SchedulerRequest) -> RequestKey:
        rid = str(request.request_id)
        key = self._keys.get(rid)
        if key is None:
            key = self._keyer.key(request)
            if key.skip_reason is not None:
                self.stats["skipped_requests"] += 1
                logger.debug("lmcache: request %s not cached: %s", rid, key.skip_reason)
            self._keys[rid] = key
        return key

    # ------------------------------------------------------------------ vLLM entry points

    def get_num_new_matched_tokens(
        self, request: SchedulerRequest, num_computed_tokens: int
    ) -> int | None:
        """Tokens lmcache can load beyond the ``num_computed_tokens`` vLLM holds (0 on any
        failure); ``None`` while an asynchronous lookup (disk / remote tiers) is in flight."""
        rid = str(getattr(request, "request_id", "?"))
        miss: int | None = 0
        return self._guard(
            "lookup", rid, miss, lambda: self._matched(request, rid, num_computed_tokens)
        )

    def _matched(self, request: SchedulerRequest, rid: str, num_computed_tokens: int) -> int | None:
        self._load_specs.pop(rid, None)
        if not self.loads_enabled or skips_reading(request):
            return 0
        key = self._key(request)
        tokens = request.prompt_token_ids or []
        if not isinstance(tokens, list):
            tokens = list(tokens)  # vLLM's own is a list already: not copied per lookup
        if key.skip_reason is not None or not tokens:
            return 0
        if (
            num_computed_tokens
            >= (int(request.num_tokens) - 1) // self.block_size * self.block_size
        ):
            return 0  # vLLM holds all that lmcache could offer: no lookup, no copy to the GPU
        hit = self.lookups.ask(
            rid,
            lambda: LookupQuery(
                rid,
                tokens,
                key.salt,
                chunk_extra_keys(key.extra_keys, len(tokens), self.chunk_size),
            ),
        )
        if hit is None:
            return None  # in flight: vLLM asks again at a later step
        # vLLM must compute >= 1 token, and a hit ends on a block boundary like vLLM's own
        # prefix-cache hits: some CPU attention kernels (AMX) round differently when a prefill
        # starts mid-block, so a mid-block hit could change greedy output versus no cache.
        usable = min(hit, int(request.num_tokens) - 1) // self.hit_align * self.hit_align
        need = usable - num_computed_tokens
        if need <= 0:
            return 0
        self._load_specs[rid] = LoadSpec(vllm_cached=num_computed_tokens, lmcache_hit=hit)
        logger.debug(
            "lmcache: request %s: %d prompt tokens, vLLM holds %d, lmcache %d, loading %d",
            rid,
            len(tokens),
            num_computed_tokens,
            hit,
            need,
        )
        return need

    def update_state_after_alloc(self, request: SchedulerRequest, num_external_tokens: int) -> None:
        """Remember the request; arm its load when vLLM accepted external tokens."""
        rid = str(getattr(request, "request_id", "?"))

        def _update() -> None:
            self._requests[rid] = request
            spec = self._load_specs.get(rid)
            if spec is None:
                return
            if num_external_tokens <= 0:
                del self._load_specs[rid]
                return
            spec.load_end = spec.vllm_cached + num_external_tokens

        self._guard("update_state_after_alloc", rid, None, _update)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> LMCacheConnectorMetadata:
        """Per-step metadata: loads of newly scheduled requests, saves of computed tokens,
        preempted requests. A request whose part fails is left out (a miss, never an error)."""
        meta = LMCacheConnectorMetadata()
        try:
            for req_id in scheduler_output.finished_req_ids:
                self._forget(str(req_id))
            meta.preempted = sorted(getattr(scheduler_output, "preempted_req_ids", None) or ())
            meta.finished, self._finished_saves = self._finished_saves, []
            num_scheduled = scheduler_output.num_scheduled_tokens
            new_reqs = list(scheduler_output.scheduled_new_reqs)
            cached = scheduler_output.scheduled_cached_reqs
            cached_ids = list(cached.req_ids)
        except Exception as exc:  # a scheduler_output we do not understand: no work this step
            self._failed("build_connector_meta", "*", exc)
            return meta
        for new in new_reqs:
            self._guard(
                "build_connector_meta",
                str(new.req_id),
                None,
                partial(self._new, meta, new, num_scheduled),
            )
        for i, req_id in enumerate(cached_ids):
            self._guard(
                "build_connector_meta",
                str(req_id),
                None,
                partial(self._cached, meta, cached, i, req_id, num_scheduled),
            )
        return meta

    def _new(
        self, meta: LMCacheConnectorMetadata, new: NewRequestData, num_scheduled: Mapping[str, int]
    ) -> None:
        rid = str(new.req_id)
        prompt = new.prompt_token_ids or []
        if not isinstance(prompt, list):
            prompt = list(prompt)  # sliced (copied) below, so vLLM's own list is not copied
        request = self._requests.get(rid)
        load = self._load_specs.pop(rid, None)
        key = self._key(request) if request is not None else RequestKey(skip_reason="unknown")
        if key.skip_reason is not None or request is None or self.inert:
            return
        hit_saved = load.lmcache_hit // self.chunk_size * self.chunk_size if load else 0
        tracker = Tracker(
            req_id=rid,
            prompt_len=len(prompt),
            block_ids=list(new.block_ids[0]) if new.block_ids else [],
            salt=key.salt,
            num_saved=hit_saved,
            extra_keys=key.extra_keys,
            group_block_ids=[list(b) for b in new.block_ids] if self.multi_group else None,
        )
        self._trackers[rid] = tracker
        start = int(new.num_computed_tokens)
        tracker.computed(start, start + int(num_scheduled.get(rid, 0)), self.chunk_size)
        self._add(
            meta, tracker, prompt, start, start + int(num_scheduled.get(rid, 0)), load, request
        )

    def _cached(
        self,
        meta: LMCacheConnectorMetadata,
        cached: CachedRequestData,
        i: int,
        req_id: str,
        num_scheduled: Mapping[str, int],
    ) -> None:
        rid = str(req_id)
        tracker = self._trackers.get(rid)
        request = self._requests.get(rid)
        if tracker is None or request is None:
            return
        resumed = req_id in (getattr(cached, "resumed_req_ids", None) or set())
        tracker.take_blocks(cached.new_block_ids[i], resumed)
        load = self._load_specs.pop(rid, None) if resumed else None
        start = int(cached.num_computed_tokens[i])
        computed_end = start + int(num_scheduled.get(req_id, 0))
        tracker.computed(start, computed_end, self.chunk_size, resumed)  # a rollback: saves again
        self._add(meta, tracker, None, start, computed_end, load, request)

    def _save_spec(self, tracker: Tracker, computed_end: int) -> SaveSpec | None:
        if self.kv_role == "kv_consumer":
            return None
        in_prefill = computed_end <= tracker.prompt_len
        if not in_prefill and not self.config.save_decode_cache:
            # the prompt's tail may have been scheduled together with the first decode
            end = tracker.prompt_len
        else:
            end = computed_end
        if end >= tracker.prompt_len and in_prefill and self.config.save_unfull_chunk:
            save_end = end  # the prompt is complete: its partial last chunk may be kept
        else:
            save_end = end // self.chunk_size * self.chunk_size
        if save_end <= tracker.num_saved:
            return None
        return SaveSpec(skip=tracker.num_saved, end=save_end)

    def _add(
        self,
        meta: LMCacheConnectorMetadata,
        tracker: Tracker,
        prompt: list[int] | None,
        computed_start: int,
        computed_end: int,
        load: LoadSpec | None,
        request: SchedulerRequest,
    ) -> None:
        if load is not None and load.load_end <= load.vllm_cached:
            load = None
        # Speculative decoding: a step also computes draft tokens, which vLLM verifies only
        # after it (a rejected draft's KV is garbage, and its slot is rewritten next step).
        # Save only known tokens (prompt + accepted output, all of them computed by the end of
        # this step); a chunk that drafts complete is saved once its last token is known.
        save = self._save_spec(tracker, min(computed_end, len(request.all_token_ids)))
        if load is None and save is None:
            return
        need = max(load.lmcache_hit if load else 0, save.end if save else 0)
        if prompt is not None and need <= len(prompt):
            tokens = prompt[:need]
        else:
            tokens = list(request.all_token_ids[:need])
        if save is not None:
            tracker.num_saved = save.end // self.chunk_size * self.chunk_size
            if save.end == tracker.prompt_len:
                tracker.num_saved = save.end  # complete prompt (partial chunk kept)
        meta.requests.append(
            ReqMeta(
                req_id=tracker.req_id,
                token_ids=tokens,
                block_ids=list(tracker.block_ids),
                salt=tracker.salt,
                extra_keys=chunk_extra_keys(tracker.extra_keys, len(tokens), self.chunk_size),
                load=load,
                save=save,
                group_block_ids=copied_groups(tracker.group_block_ids),
                computed_start=computed_start,
            )
        )

    def _forget(self, rid: str) -> Tracker | None:
        self.lookups.forget(rid)  # an answer still in flight is dropped unread
        self._requests.pop(rid, None)
        self._load_specs.pop(rid, None)
        self._keys.pop(rid, None)
        return self._trackers.pop(rid, None)

    def request_finished(self, request: SchedulerRequest, block_ids: Sequence[int]) -> None:
        """Forget the request (its worker-side leases go with ``finished_req_ids``), after
        noting the save of chunks that its last step completed with accepted speculative
        tokens (:meth:`_save_finished`)."""
        self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: SchedulerRequest, block_ids: Sequence[Sequence[int]]
    ) -> None:
        """:meth:`request_finished` with the request's blocks of every KV cache group."""
        rid = str(getattr(request, "request_id", "?"))
        save = partial(self._save_finished, request, rid, block_ids)
        self._guard("request_finished", rid, None, save)
        self._guard("request_finished", rid, None, lambda: self._forget(rid))

    def _save_finished(
        self, request: SchedulerRequest, rid: str, block_ids: Sequence[Sequence[int]]
    ) -> None:
        """Speculative decoding: the draft tokens that vLLM accepted in a request's last step
        were unknown when that step's save was planned, so a chunk they completed is saved
        now, from ``block_ids`` (vLLM's blocks of the request, freed when this returns). The
        save goes with the next step's metadata, and the workers copy it before that step
        rewrites any page (``LMCacheConnectorMetadata.finished``)."""
        tracker = self._trackers.get(rid)
        if tracker is None:
            return
        # KV in vLLM's pages: tokens computed by the steps processed so far (vLLM's own "safe
        # frontier"; asynchronous scheduling counts a step in flight as computed already) that
        # are known (a step may compute drafts beyond the tokens kept at a stop)
        placeholders = int(getattr(request, "num_output_placeholders", 0) or 0)
        done = int(getattr(request, "num_computed_tokens", 0) or 0) - placeholders
        save = self._save_spec(tracker, min(done, len(request.all_token_ids)))
        if save is None or not block_ids or len(block_ids[0]) * self.block_size < save.end:
            return
        tokens = list(request.all_token_ids[: save.end])
        self._finished_saves.append(
            ReqMeta(
                req_id=rid,
                token_ids=tokens,
                block_ids=[int(b) for b in block_ids[0]],
                salt=tracker.salt,
                extra_keys=chunk_extra_keys(tracker.extra_keys, len(tokens), self.chunk_size),
                save=save,
                group_block_ids=copied_groups(block_ids) if self.multi_group else None,
                computed_start=done,
            )
        )

    def reset_cache(self) -> bool:
        """Ask every worker rank to drop this engine's chunks."""
        if self.inert:
            return True  # no worker holds any
        return self._guard("reset_cache", "*", False, lambda: self.lookups.get_client().clear())

    def take_stats(self) -> dict[str, float] | None:
        """Counters since the last call (``None`` when nothing happened)."""
        client = self.lookups.client
        if client is not None:  # ranks that missed the client's deadline
            timeouts = int(getattr(client, "timeouts", 0))
            self.stats["lookup_timeouts"] += timeouts - self._client_timeouts
            self._client_timeouts = timeouts
        late = self.lookups.late  # lookups still pending past their deadline
        self.stats["lookup_timeouts"] += late - self._late_lookups
        self._late_lookups = late
        if not any(self.stats.values()):
            return None
        out = {k: float(v) for k, v in self.stats.items()}
        self.stats = dict.fromkeys(self.stats, 0)
        return out

    def close(self) -> None:
        """Close the lookup connections (idempotent)."""
        self.lookups.close()
