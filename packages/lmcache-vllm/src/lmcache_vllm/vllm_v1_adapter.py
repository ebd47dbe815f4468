# SPDX-License-Identifier: Apache-2.0
"""``LMCacheConnectorV1Impl``: lmcache behind vLLM's ``KVConnectorBase_V1`` (vLLM 0.32/0.33).

vLLM builds the connector twice: once in the scheduler (``KVConnectorRole.SCHEDULER``) and once
in every worker (``KVConnectorRole.WORKER``); with tensor parallelism or the default
multiprocess executor these live in different processes. One :class:`LMCacheConnectorV1Impl`
holds both sides; vLLM's in-tree ``LMCacheConnectorV1`` (imported through
``lmcache.integration.vllm.vllm_v1_adapter``) and our :mod:`lmcache_vllm.connector` construct it
as ``LMCacheConnectorV1Impl(vllm_config, role, parent)`` and delegate.

Per request, step by step:

1. Scheduler, :meth:`get_num_new_matched_tokens`: asks every worker rank (Unix-socket
   :mod:`~lmcache_vllm.lookup`) how many leading prompt tokens lmcache holds, takes the
   minimum, and reports the tokens beyond vLLM's own prefix-cache hit (one less on a full hit,
   so vLLM computes the last token). A lookup failure is a miss.
2. Scheduler, :meth:`update_state_after_alloc` then :meth:`build_connector_meta`: records what
   to load (tokens ``[vllm_cached, load_end)``) and what to save (the tokens computed this step
   that are not saved yet) in picklable plain dataclasses: token ids, block ids, salt.
3. Worker, :meth:`start_load_kv`: one batched ``LMCacheEngine.retrieve`` per request (or a
   layerwise retrieve driven by :meth:`wait_for_layer_load`). Tokens that did not arrive make
   their blocks a load error (:meth:`get_block_ids_with_load_errors`): vLLM recomputes them.
4. Worker, :meth:`wait_for_save`: one batched ``LMCacheEngine.store`` per request (or the
   layerwise store fed by :meth:`save_kv_layer`). Saves are synchronous, so
   :meth:`request_finished` never holds blocks.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

import torch

from lmcache.cache_engine import LMCacheEngine
from lmcache.config import LMCacheConfig, load_config
from lmcache.gpu_connector import CreateGPUConnector, EngineInfo, KVLayoutError, TransferSpec
from lmcache.metadata import LMCacheMetadata
from lmcache.metrics import LMCacheMetrics
from lmcache.tiers import process_cpu_tier
from lmcache_vllm.connector_metadata import (
    LMCacheConnectorMetadata,
    LoadSpec,
    ReqMeta,
    SaveSpec,
    Tracker,
    WorkerStats,
)
from lmcache_vllm.cpu_layout_probe import probe_cpu_kv_format
from lmcache_vllm.lookup import LookupClient, LookupServer
from lmcache_vllm.utils import calculate_local_rank_and_world_size

if TYPE_CHECKING:
    from lmcache.cache_engine import LayerwiseRetrieve, LayerwiseStore

__all__ = [
    "LMCacheConnectorMetadata",
    "LMCacheConnectorV1Impl",
    "LoadSpec",
    "ReqMeta",
    "SaveSpec",
    "WorkerStats",
    "live_engines",
    "load_lmcache_config",
]

logger = logging.getLogger(__name__)

# ------------------------------------------------------------------------ config / engine


def load_lmcache_config(vllm_config: Any) -> LMCacheConfig:
    """lmcache config: defaults < ``LMCACHE_CONFIG_FILE`` < ``LMCACHE_*`` env <
    ``kv_connector_extra_config`` keys starting with ``lmcache.``."""
    ktc = vllm_config.kv_transfer_config
    extra = dict(getattr(ktc, "kv_connector_extra_config", None) or {})
    overrides = {k: v for k, v in extra.items() if isinstance(k, str) and k.startswith("lmcache.")}
    return load_config(overrides=overrides)


_LIVE: weakref.WeakSet[LMCacheEngine] = weakref.WeakSet()


def live_engines() -> list[LMCacheEngine]:
    """Worker-side ``LMCacheEngine`` objects of this process (for tests, demos, debugging)."""
    return list(_LIVE)


def _make_engine(config: LMCacheConfig, metadata: LMCacheMetadata, connector: Any) -> LMCacheEngine:
    """An engine on the process-wide CPU tier, which outlives this vLLM instance (a fresh
    ``LLM`` in the same process sees what an earlier one stored)."""
    metrics = LMCacheMetrics()
    engine = LMCacheEngine(
        config, metadata, connector, metrics=metrics, tier=process_cpu_tier(config, metrics)
    )
    _LIVE.add(engine)
    return engine


def _layer_index(name: str, fallback: int) -> int:
    try:
        from vllm.model_executor.models.utils import extract_layer_index

        return int(extract_layer_index(name))
    except Exception:
        return fallback


# ------------------------------------------------------------------------ the implementation


class LMCacheConnectorV1Impl:
    """Both sides of the lmcache connector; see the module docstring.

    Args:
        vllm_config: vLLM's ``VllmConfig``.
        role: ``KVConnectorRole.SCHEDULER`` or ``KVConnectorRole.WORKER``.
        parent: The ``KVConnectorBase_V1`` delegating to this object (source of the bound
            connector metadata).
    """

    def __init__(self, vllm_config: Any, role: Any, parent: Any) -> None:
        self._vllm_config = vllm_config
        self._parent = parent
        self._role_name = getattr(role, "name", str(role))
        self.is_scheduler = self._role_name == "SCHEDULER"
        ktc = vllm_config.kv_transfer_config
        self.kv_role: str = getattr(ktc, "kv_role", None) or "kv_both"
        self.engine_id: str = str(getattr(ktc, "engine_id", None) or "lmcache-default")
        self.config = load_lmcache_config(vllm_config)
        self.chunk_size = self.config.chunk_size
        self.block_size: int = int(vllm_config.cache_config.block_size)
        pc = vllm_config.parallel_config
        self.world_size = int(pc.tensor_parallel_size) * int(
            getattr(pc, "pipeline_parallel_size", 1)
        )
        self.rank = int(getattr(pc, "rank", 0))
        if self.is_scheduler:
            self._prefer_recompute_on_load_failure(ktc)
        # scheduler side
        self._lookup_client: LookupClient | None = None
        self._load_specs: dict[str, LoadSpec] = {}
        self._trackers: dict[str, Tracker] = {}
        self._requests: dict[str, Any] = {}
        # worker side
        self.lmcache_engine: LMCacheEngine | None = None
        self._lookup_server: LookupServer | None = None
        self._layer_ids: dict[str, int] = {}
        self._load_errors: set[int] = set()
        self._retrievers: list[tuple[ReqMeta, LayerwiseRetrieve]] = []
        self._storers: list[tuple[ReqMeta, LayerwiseStore]] = []
        self._storers_started = False
        self._stats = WorkerStats()
        self._stats_lock = threading.Lock()
        logger.info(
            "lmcache connector (%s) for engine %s: chunk_size=%d block_size=%d layerwise=%s",
            self._role_name,
            self.engine_id,
            self.chunk_size,
            self.block_size,
            self.config.use_layerwise,
        )

    # ================================================================ scheduler side

    @staticmethod
    def _prefer_recompute_on_load_failure(ktc: Any) -> None:
        """A chunk that vanishes between lookup and load (evicted, checksum mismatch) must cost
        a recompute, not a failed request: switch vLLM's ``kv_load_failure_policy`` from its
        default ``"fail"`` to ``"recompute"`` (the scheduler reads it after building us).
        ``kv_connector_extra_config={"lmcache_vllm.keep_load_failure_policy": true}`` keeps
        vLLM's setting."""
        extra = getattr(ktc, "kv_connector_extra_config", None) or {}
        if str(extra.get("lmcache_vllm.keep_load_failure_policy", "")).lower() in ("1", "true"):
            return
        if getattr(ktc, "kv_load_failure_policy", None) == "fail":
            ktc.kv_load_failure_policy = "recompute"
            logger.info(
                "lmcache: kv_load_failure_policy set to 'recompute' (a failed lmcache load is "
                "recomputed); set kv_connector_extra_config "
                "{'lmcache_vllm.keep_load_failure_policy': true} to keep 'fail'"
            )

    def _client(self) -> LookupClient:
        if self._lookup_client is None:
            self._lookup_client = LookupClient(self.engine_id, self.world_size)
        return self._lookup_client

    @staticmethod
    def _salt(request: Any) -> str:
        return str(getattr(request, "cache_salt", None) or "")

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens lmcache can load beyond the ``num_computed_tokens`` vLLM holds.

        Returns an ``int`` (vLLM's in-tree wrapper adds the ``load_async=False`` flag).
        """
        self._load_specs.pop(request.request_id, None)
        if self.kv_role == "kv_producer":
            return 0
        tokens = list(request.prompt_token_ids or [])
        if not tokens:
            return 0
        hit = self._client().lookup(tokens, self._salt(request))
        usable = min(hit, int(request.num_tokens) - 1)  # vLLM must compute >= 1 token
        need = usable - num_computed_tokens
        if need <= 0:
            return 0
        self._load_specs[request.request_id] = LoadSpec(
            vllm_cached=num_computed_tokens, lmcache_hit=hit
        )
        logger.debug(
            "lmcache: request %s: %d prompt tokens, vLLM holds %d, lmcache %d, loading %d",
            request.request_id,
            len(tokens),
            num_computed_tokens,
            hit,
            need,
        )
        return need

    def update_state_after_alloc(self, request: Any, num_external_tokens: int) -> None:
        """Remember the request; arm its load when vLLM accepted external tokens."""
        self._requests[request.request_id] = request
        spec = self._load_specs.get(request.request_id)
        if spec is None:
            return
        if num_external_tokens <= 0:
            del self._load_specs[request.request_id]
            return
        spec.load_end = spec.vllm_cached + num_external_tokens

    def _save_spec(self, tracker: Tracker, computed_end: int, is_new: bool) -> SaveSpec | None:
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

    def build_connector_meta(self, scheduler_output: Any) -> LMCacheConnectorMetadata:
        """Per-step metadata: loads of newly scheduled requests, saves of computed tokens."""
        meta = LMCacheConnectorMetadata()
        for req_id in scheduler_output.finished_req_ids:
            self._trackers.pop(req_id, None)
            self._requests.pop(req_id, None)
            self._load_specs.pop(req_id, None)

        num_sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            prompt = list(new.prompt_token_ids or [])
            request = self._requests.get(new.req_id)
            salt = self._salt(request) if request is not None else ""
            load = self._load_specs.pop(new.req_id, None)
            hit_saved = 0
            if load is not None:
                hit_saved = load.lmcache_hit // self.chunk_size * self.chunk_size
            tracker = Tracker(
                req_id=new.req_id,
                prompt_len=len(prompt),
                block_ids=list(new.block_ids[0]) if new.block_ids else [],
                salt=salt,
                num_saved=hit_saved,
            )
            self._trackers[new.req_id] = tracker
            computed_end = int(new.num_computed_tokens) + int(num_sched.get(new.req_id, 0))
            self._add(meta, tracker, prompt, computed_end, load, request)

        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracker = self._trackers.get(req_id)
            request = self._requests.get(req_id)
            if tracker is None or request is None:
                continue
            new_blocks = cached.new_block_ids[i]
            resumed = req_id in getattr(cached, "resumed_req_ids", set())
            if resumed:
                tracker.block_ids = list(new_blocks[0]) if new_blocks else []
            elif new_blocks:
                tracker.block_ids.extend(new_blocks[0])
            load = self._load_specs.pop(req_id, None) if resumed else None
            computed_end = int(cached.num_computed_tokens[i]) + int(num_sched.get(req_id, 0))
            self._add(meta, tracker, None, computed_end, load, request)
        return meta

    def _add(
        self,
        meta: LMCacheConnectorMetadata,
        tracker: Tracker,
        prompt: list[int] | None,
        computed_end: int,
        load: LoadSpec | None,
        request: Any,
    ) -> None:
        if load is not None and load.load_end <= load.vllm_cached:
            load = None
        save = self._save_spec(tracker, computed_end, prompt is not None)
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
                load=load,
                save=save,
            )
        )

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Saves are synchronous (done in ``wait_for_save``): blocks can be freed now."""
        self._trackers.pop(request.request_id, None)
        self._requests.pop(request.request_id, None)
        self._load_specs.pop(request.request_id, None)
        return False, None

    def get_kv_events(self) -> list[Any]:
        """No KV events are published."""
        return []

    def reset_cache(self) -> bool:
        """Empty lmcache on every worker rank (``reset_prefix_cache(reset_connector=True)``)."""
        if self.is_scheduler:
            return self._client().clear()
        if self.lmcache_engine is not None:
            self.lmcache_engine.clear()
        return True

    # ================================================================ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Build the metadata, GPU connector, cache engine and lookup server from the caches."""
        if not kv_caches:
            raise KVLayoutError("vLLM registered no KV caches with the lmcache connector")
        names = list(kv_caches)
        order = sorted(range(len(names)), key=lambda i: (_layer_index(names[i], i), i))
        names = [names[i] for i in order]
        caches = [kv_caches[n] for n in names]
        self._layer_ids = {n: i for i, n in enumerate(names)}
        vc = self._vllm_config
        mc = vc.model_config
        first = caches[0]
        use_mla = bool(getattr(mc, "use_mla", False))
        if use_mla:
            latent = int(first.shape[-1])
            heads, hk, hv = 1, latent, 0
        else:
            if first.dim() != 4:
                raise KVLayoutError(
                    f"vLLM KV cache {tuple(first.shape)} strides {tuple(first.stride())}: expected "
                    "the 0.32/0.33 per-layer view [num_blocks, kv_heads, block_size, head_k + "
                    "head_v]"
                )
            heads = int(first.shape[1])
            hk = int(mc.get_head_size())
            hv = int(first.shape[3]) - hk
        local_rank, local_world = calculate_local_rank_and_world_size(vc)
        metadata = LMCacheMetadata(
            model_name=str(mc.model),
            world_size=self.world_size,
            worker_id=self.rank,
            local_worker_id=local_rank,
            local_world_size=local_world,
            kv_dtype=first.dtype,
            num_layers=len(caches),
            num_kv_heads=heads,
            head_size_k=hk,
            head_size_v=hv,
            use_mla=use_mla,
            chunk_size=self.chunk_size,
        )
        device = first.device.type
        hints: dict[str, Any] = {}
        if use_mla:
            hints["kv_format"] = "mla"
        elif device == "cpu":
            hints["kv_format"] = probe_cpu_kv_format(vc, names, first)
        engine_info = EngineInfo(
            name="vllm", device=device, kv_caches=caches, extra={"block_size": self.block_size}
        )
        connector = CreateGPUConnector(self.config, metadata, engine_info, hints)
        self.lmcache_engine = _make_engine(self.config, metadata, connector)
        engine = self.lmcache_engine
        self._lookup_server = LookupServer(
            self.engine_id,
            self.rank,
            lambda tokens, salt: engine.lookup(tokens, salt=salt),
            engine.clear,
        )
        logger.info(
            "lmcache: registered %d layers %s on %s (%s), lookup socket %s",
            len(caches),
            tuple(first.shape),
            device,
            hints.get("kv_format", "default"),
            self._lookup_server.path,
        )

    def _slot_mapping(self, req: ReqMeta, num_tokens: int) -> torch.Tensor:
        blocks = torch.tensor(req.block_ids, dtype=torch.long)
        offs = torch.arange(self.block_size, dtype=torch.long)
        slots = (blocks[:, None] * self.block_size + offs[None, :]).flatten()
        if slots.numel() >= num_tokens:
            return slots[:num_tokens]
        pad = torch.full((num_tokens - slots.numel(),), -1, dtype=torch.long)
        return torch.cat((slots, pad))

    def _mask(self, num_tokens: int, skip: int) -> torch.Tensor:
        mask = torch.ones(num_tokens, dtype=torch.bool)
        mask[: skip // self.chunk_size * self.chunk_size] = False
        return mask

    def _load_plan(self, req: ReqMeta) -> tuple[list[int], torch.Tensor, TransferSpec, int] | None:
        load = req.load
        assert load is not None
        covered = len(req.block_ids) * self.block_size
        n = load.lmcache_hit
        if n > covered:  # keys need whole chunks; never write past allocated blocks
            n = min(load.load_end // self.chunk_size * self.chunk_size, covered)
        if n <= load.vllm_cached:
            return None
        tokens = req.token_ids[:n]
        transfer = TransferSpec(self._slot_mapping(req, n), skip_tokens=load.vllm_cached)
        return tokens, self._mask(n, load.vllm_cached), transfer, n

    def _record_load(self, req: ReqMeta, loaded: torch.Tensor | None, n_plan: int) -> None:
        load = req.load
        assert load is not None
        lo, hi = load.vllm_cached, load.load_end
        ok = torch.zeros(hi - lo, dtype=torch.bool)
        if loaded is not None:
            have = loaded[lo : min(hi, loaded.numel())]
            ok[: have.numel()] = have
        missing = (~ok).nonzero()
        with self._stats_lock:
            self._stats.expected_load_tokens += hi - lo
            self._stats.loaded_tokens += int(ok.sum())
            self._stats.num_loads += 1
        if missing.numel() == 0:
            return
        first_bad = lo + int(missing[0])
        bad_blocks = req.block_ids[first_bad // self.block_size : -(-hi // self.block_size)]
        self._load_errors.update(bad_blocks)
        with self._stats_lock:
            self._stats.failed_load_tokens += hi - first_bad
        logger.warning(
            "lmcache: request %s loaded %d of %d tokens (first missing token %d); blocks %s "
            "reported to vLLM for recompute",
            req.req_id,
            int(ok.sum()),
            hi - lo,
            first_bad,
            bad_blocks,
        )

    def bind_connector_metadata(self, metadata: Any) -> None:
        """Per-step reset of the layerwise state (vLLM calls this before each step)."""
        self._finish_layerwise()
        self._storers_started = False

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Load every request's hit (one batched retrieve each, or start layerwise loads)."""
        meta = self._parent._get_connector_metadata()
        if not isinstance(meta, LMCacheConnectorMetadata) or self.lmcache_engine is None:
            return
        engine = self.lmcache_engine
        for req in meta.requests:
            if req.load is None:
                continue
            plan = self._load_plan(req)
            if plan is None:
                self._record_load(req, None, 0)
                continue
            tokens, mask, transfer, n = plan
            started = time.perf_counter()
            try:
                if self.config.use_layerwise:
                    retriever = engine.retrieve_layerwise(tokens, mask, transfer, salt=req.salt)
                    self._retrievers.append((req, retriever))
                    continue
                loaded = engine.retrieve(tokens, mask, transfer, salt=req.salt)
            except Exception:
                logger.exception("lmcache: load of request %s failed; recomputing", req.req_id)
                loaded = None
            with self._stats_lock:
                self._stats.load_seconds += time.perf_counter() - started
            self._record_load(req, loaded, n)
        for req, retriever in self._retrievers:
            if retriever.num_hit_tokens < req.load.load_end - req.load.vllm_cached:  # type: ignore[union-attr]
                mask = torch.zeros(len(req.token_ids), dtype=torch.bool)
                lo = req.load.vllm_cached // self.chunk_size * self.chunk_size  # type: ignore[union-attr]
                mask[lo : lo + retriever.num_hit_tokens] = True
                self._record_load(req, mask, 0)
            else:
                self._record_load(req, torch.ones(len(req.token_ids), dtype=torch.bool), 0)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layerwise: load ``layer_name`` of every pending retrieve."""
        if not self._retrievers:
            return
        layer = self._layer_ids.get(layer_name)
        if layer is None:
            return
        for req, retriever in list(self._retrievers):
            try:
                retriever.load_layer(layer)
            except Exception:
                logger.exception("lmcache: layerwise load of %s failed", req.req_id)
                self._retrievers.remove((req, retriever))
                self._fail_whole_load(req)

    def _fail_whole_load(self, req: ReqMeta) -> None:
        load = req.load
        if load is None:
            return
        self._load_errors.update(
            req.block_ids[
                load.vllm_cached // self.block_size : -(-load.load_end // self.block_size)
            ]
        )

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Layerwise: save ``layer_name`` of every request with tokens to save this step."""
        if not self.config.use_layerwise or self.lmcache_engine is None:
            return
        layer = self._layer_ids.get(layer_name)
        if layer is None:
            return
        if not self._storers_started:
            self._storers_started = True
            meta = self._parent._get_connector_metadata()
            if isinstance(meta, LMCacheConnectorMetadata):
                for req in meta.requests:
                    if req.save is None:
                        continue
                    tokens = req.token_ids[: req.save.end]
                    transfer = TransferSpec(self._slot_mapping(req, len(tokens)))
                    try:
                        storer = self.lmcache_engine.store_layerwise(
                            tokens,
                            self._mask(len(tokens), req.save.skip),
                            transfer,
                            salt=req.salt,
                        )
                    except Exception:
                        logger.exception("lmcache: layerwise save of %s failed", req.req_id)
                        continue
                    self._storers.append((req, storer))
        for req, storer in list(self._storers):
            try:
                storer.store_layer(layer)
            except Exception:
                logger.exception("lmcache: layerwise save of %s failed", req.req_id)
                self._storers.remove((req, storer))

    def _finish_layerwise(self) -> None:
        for req, retriever in self._retrievers:
            try:
                retriever.finish()
            except Exception as exc:  # layers missing: the forward did not call us per layer
                logger.warning("lmcache: layerwise load of %s incomplete (%s)", req.req_id, exc)
                self._fail_whole_load(req)
        self._retrievers = []
        for req, storer in self._storers:
            started = time.perf_counter()
            try:
                stored = storer.finish()
            except Exception as exc:
                logger.warning("lmcache: layerwise save of %s incomplete (%s)", req.req_id, exc)
                continue
            with self._stats_lock:
                self._stats.stored_tokens += stored
                self._stats.num_saves += 1
                self._stats.save_seconds += time.perf_counter() - started
        self._storers = []

    def wait_for_save(self) -> None:
        """Save every request's newly computed tokens (one batched store each)."""
        if self.config.use_layerwise:
            self._finish_layerwise()
            self._storers_started = False
            return
        meta = self._parent._get_connector_metadata()
        if not isinstance(meta, LMCacheConnectorMetadata) or self.lmcache_engine is None:
            return
        for req in meta.requests:
            if req.save is None:
                continue
            tokens = req.token_ids[: req.save.end]
            transfer = TransferSpec(self._slot_mapping(req, len(tokens)))
            started = time.perf_counter()
            try:
                stored = self.lmcache_engine.store(
                    tokens, self._mask(len(tokens), req.save.skip), transfer, salt=req.salt
                )
            except Exception:
                logger.exception("lmcache: save of request %s failed", req.req_id)
                continue
            with self._stats_lock:
                self._stats.stored_tokens += stored
                self._stats.num_saves += 1
                self._stats.save_seconds += time.perf_counter() - started

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """No asynchronous transfers."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (vLLM recomputes them)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_stats(self) -> dict[str, float] | None:
        """Worker counters since the last call (``None`` when nothing happened)."""
        with self._stats_lock:
            stats, self._stats = self._stats, WorkerStats()
        if stats.num_loads == 0 and stats.num_saves == 0:
            return None
        return stats.as_dict()

    def shutdown(self) -> None:
        """Stop the lookup server/client; the stored chunks stay for later engines."""
        if self._lookup_server is not None:
            self._lookup_server.close()
            self._lookup_server = None
        if self._lookup_client is not None:
            self._lookup_client.close()
            self._lookup_client = None
        for _, retriever in self._retrievers:
            retriever.abort()
        for _, storer in self._storers:
            storer.abort()
        self._retrievers, self._storers = [], []
        if self.lmcache_engine is not None:
            self.lmcache_engine.close()  # the process-wide tier keeps the chunks
        self.lmcache_engine = None
