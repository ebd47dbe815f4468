# SPDX-License-Identifier: Apache-2.0
"""SGLang's ``--enable-lmcache`` connector, run in process on lmcache's engine (SGLang 0.5.21+).

SGLang's ``LMCacheUnifiedRadixCache`` imports
``lmcache.integration.sglang.unified_lmcache_mp_connector.UnifiedLMCacheMPConnector`` (core keeps
that path as a shim forwarding here). LMCache's own connector talks to a separate daemon
(``mp_host``/``mp_port``); this one runs lmcache's :class:`~lmcache.cache_engine.LMCacheEngine`
inside the SGLang worker, on the process CPU tier, keyed by token chunks exactly like the vLLM
adapter (model fingerprint, rank, and the request's salt built from SGLang's ``extra_key`` --
which carries the LoRA adapter -- and ``cache_salt``).

The flow SGLang drives:

- ``submit_lookup`` at prefetch: the stored prefix is found, checksum-verified and *leased*
  (:meth:`~lmcache.cache_engine.LMCacheEngine.lookup_and_lease`), so it cannot be evicted before
  the load; ``poll_lookup`` returns it. ``free_lookup_locks`` / ``finish_request`` release it.
  On CUDA the chunks carry sums computed on the GPU, verified on the GPU at load instead.
- ``submit_load`` at admission: the leased chunks are copied into the request's new slots
  (skipping the tokens SGLang's device cache holds) before it returns; a load that cannot land
  in full (a chunk that fails its checksum is not written) raises, and SGLang falls back to
  prefill. ``ready_prefix_count`` /
  ``complete_load`` then report it.
- ``get_store_start`` / ``submit_store`` at checkpoints: the chunks after what this request
  stored already are copied out on a background thread (asynchronous; SGLang keeps the tree
  node locked until ``complete_store``), into the CPU tier and, write-through, the disk or
  remote tier the config names (``local_disk``, ``remote_url``), which outlive the process.

Only full-attention KV pools (MHA, MLA) are cached: with a Mamba or sliding-window component
every lookup is a miss and nothing is stored (one warning naming them). SGLang's hybrid flow
would need the window's tail and the Mamba state at the hit's end with each chunk
(``device_indices_by_group``); the HiCache backend stores them (:mod:`.hicache_pools`). Every lmcache failure in a hook is a
miss or a skipped store, never a request error.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import yaml

from lmcache.cache_engine import LMCacheEngine
from lmcache.config import CONFIG_FILE_ENV, ENV_PREFIX, ConfigError, LMCacheConfig, load_config
from lmcache.devices import get_backend
from lmcache.gpu_connector import CreateGPUConnector
from lmcache.gpu_connector.interface import TransferSpec
from lmcache.metrics import LMCacheMetrics
from lmcache.tiers import process_cpu_tier
from lmcache_sglang.hook_config import (
    LMCACHE_DAEMON_KEYS,
    log_start_line,
    model_facts,
    strip_daemon_keys,
)
from lmcache_sglang.kv_pools import build_metadata, device_pool_layers
from lmcache_sglang.mp_metadata import LoadOp, LookupOp, StoreOp
from lmcache_sglang.sglang_types import KVPoolAllocator

__all__ = ["UnifiedLMCacheMPConnector", "lmcache_config_for_sglang"]

logger = logging.getLogger(__name__)


def lmcache_config_for_sglang(config_file: str | None, *, log: bool = True) -> LMCacheConfig:
    """lmcache config of ``--lmcache-config-file`` (our YAML keys), ``LMCACHE_*`` env and
    ``LMCACHE_CONFIG_FILE`` (read when no file is given). LMCache's daemon keys (``mp_host``,
    ``mp_port``) are accepted and ignored, with one log line (none when ``log`` is false).

    Raises:
        ConfigError: an unreadable file or a bad key/value (naming the file and the key).
    """
    path = config_file or os.environ.get(CONFIG_FILE_ENV) or None
    if path is None:
        return load_config()
    via = "--lmcache-config-file" if config_file else CONFIG_FILE_ENV
    source = f"{via} {path!r}"
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(
            f"{source}: cannot read it as YAML ({exc}); expected a mapping of lmcache config "
            "keys such as 'chunk_size: 256'."
        ) from exc
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{source}: expected a mapping of lmcache config keys at the top level, found "
            f"{type(raw).__name__}."
        )
    if not LMCACHE_DAEMON_KEYS & set(raw):
        return load_config(path)
    if log:
        raw = strip_daemon_keys(raw, source)
    else:
        raw = {k: v for k, v in raw.items() if k not in LMCACHE_DAEMON_KEYS}
    # The file's keys go in as overrides; keep the usual order (file < LMCACHE_* env).
    env = {k: v for k, v in os.environ.items() if k != CONFIG_FILE_ENV}
    from_env = {k[len(ENV_PREFIX) :].lower() for k in env if k.startswith(ENV_PREFIX)}
    raw = {k: v for k, v in raw.items() if str(k).removeprefix("lmcache.") not in from_env}
    try:
        return load_config(env=env, overrides=raw)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from exc


def _done(value: Any) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future


class UnifiedLMCacheMPConnector:
    """In-process stand-in for LMCache's multiprocess connector (see the module docstring).

    Constructed by SGLang's ``LMCacheUnifiedRadixCache`` with keyword arguments.

    Raises:
        ConfigError: bad lmcache configuration.
    """

    operation_timeout: float = 60.0

    def __init__(
        self,
        *,
        config_file: str | None,
        model_config: object,
        tp_size: int,
        tp_rank: int,
        tp_group: Any = None,
        pp_size: int = 1,
        pp_rank: int = 0,
        pp_group: Any = None,
        page_size: int,
        token_to_kv_pool_allocator: KVPoolAllocator,
        req_to_token_pool: Any = None,
        tree_components: Sequence[object] = (),
        mamba_component: Any = None,
        sliding_window_size: int | None = None,
        **_: Any,
    ) -> None:
        self.config = lmcache_config_for_sglang(config_file)
        self.chunk_size = self.config.chunk_size
        self.page_size = int(page_size)
        self.tp_size, self.tp_rank, self.tp_group = int(tp_size), int(tp_rank), tp_group
        self.sliding_window_size = sliding_window_size
        self.engine: LMCacheEngine | None = None
        self._lookups: dict[str, LookupOp] = {}
        self._stored_upto: dict[str, int] = {}
        self._lock = threading.Lock()
        self._store_pool = ThreadPoolExecutor(1, thread_name_prefix="lmcache-sglang-store")
        names = {str(getattr(c, "name", c)).upper() for c in tree_components}
        names |= {"MAMBA"} if mamba_component is not None else set()
        swa = {f"SWA (window {sliding_window_size})"} if sliding_window_size else set()
        unsupported = (names - {"FULL", "COMPONENTTYPE.FULL"} - ({"SWA"} if swa else set())) | swa
        if unsupported:
            logger.warning(
                "lmcache (--enable-lmcache): this model's cache has %s beside full attention, "
                "which lmcache does not store here, so lmcache is off for it: every lookup "
                "misses and nothing is stored; SGLang computes every prompt (its own radix "
                "cache still works). lmcache's HiCache backend stores SWA and Mamba pools "
                "(--hicache-storage-backend dynamic with LMCacheHiCacheStorage).",
                ", ".join(sorted(unsupported)),
            )
            return
        try:
            self.engine = self._build_engine(model_config, token_to_kv_pool_allocator, pp_rank)
        except ConfigError:
            raise
        except Exception as exc:
            logger.warning(
                "lmcache: cannot cache this SGLang KV pool (%s); every request runs without "
                "lmcache.",
                exc,
            )

    def _build_engine(
        self, model_config: object, allocator: KVPoolAllocator, pp_rank: int
    ) -> LMCacheEngine:
        try:
            from sglang.srt.runtime_context import get_server_args

            facts = model_facts(get_server_args())
        except Exception:
            facts = model_facts(model_config)
        layers = device_pool_layers(allocator.get_kvcache(), self.page_size)
        metadata = build_metadata(
            layers,
            model_name=facts.model_name + (f"#pp{pp_rank}" if pp_rank else ""),
            page_size=self.chunk_size,
            world_size=self.tp_size,
            rank=self.tp_rank,
            model_revision=facts.model_revision,
            quantization=facts.quantization,
            kv_cache_dtype=facts.kv_cache_dtype,
            model_digest=facts.model_digest,
        )
        connector = CreateGPUConnector(
            self.config, metadata, layers.engine_info(self.page_size), layers.layout_hints
        )
        self.device = layers.device
        metrics = LMCacheMetrics(labels={"engine": "sglang", "hook": "enable_lmcache"})
        engine = LMCacheEngine(
            self.config,
            metadata,
            connector,
            metrics=metrics,
            tier=process_cpu_tier(self.config, metrics),
        )
        log_start_line("--enable-lmcache", self.device)
        logger.info(
            "lmcache (--enable-lmcache, in process): model=%s rank=%d/%d chunk=%d layers=%d",
            metadata.model_name,
            metadata.worker_id,
            metadata.world_size,
            self.chunk_size,
            metadata.num_layers,
        )
        return engine

    # -- helpers ---------------------------------------------------------------------------

    def build_cache_salt(self, cache_salt: str | None, extra_key: str | None) -> str:
        """The lmcache salt of a request: SGLang's ``extra_key`` (LoRA id included) and
        ``cache_salt`` as a JSON list (``None`` and ``""`` differ); with neither, vLLM's plain
        salt ``""``, so both engines share a plain prompt's chunks (node cache)."""
        if extra_key is None and cache_salt is None:
            return ""
        return json.dumps([extra_key, cache_salt], separators=(",", ":"))

    def parallel_all_reduce(self, tensor: torch.Tensor, op: Any) -> None:
        """Reduce ``tensor`` over the tensor-parallel group (no-op on one rank)."""
        if self.tp_size > 1 and torch.distributed.is_initialized():
            torch.distributed.all_reduce(tensor, op=op, group=self.tp_group)

    def aligned_swa_window_size(self) -> int:
        window = int(self.sliding_window_size or 0)
        return -(-window // self.page_size) * self.page_size

    def device_indices_by_group(
        self,
        device_indices: torch.Tensor,
        mamba_value: Any = None,
        mamba_transfer_tokens: int | None = None,
    ) -> torch.Tensor:
        """The full-attention slots (the only group lmcache moves)."""
        return device_indices

    def reset_mamba_checkpoint_metadata(self, physical: Any) -> None:
        """Mamba is not cached by lmcache: nothing to reset."""

    @staticmethod
    def _slot_mapping(num_tokens: int, start: int, slots: torch.Tensor) -> torch.Tensor:
        mapping = torch.full((num_tokens,), -1, dtype=torch.int64)
        mapping[start:] = slots.to("cpu", torch.int64)
        return mapping

    # -- lookup ----------------------------------------------------------------------------

    def submit_lookup(
        self,
        request_id: str,
        token_ids: Sequence[int],
        *,
        local_hit_tokens: int = 0,
        cache_salt: str = "",
    ) -> LookupOp:
        """Find and lease the stored prefix of ``token_ids`` (done at once)."""
        op = LookupOp(str(request_id), list(token_ids), cache_salt, int(local_hit_tokens))
        if self.engine is None or not op.token_ids:
            return op
        try:
            op.held = self.engine.lookup_and_lease(op.token_ids, salt=cache_salt)
            op.future = _done(op.held.num_tokens)
        except Exception as exc:
            logger.warning("lmcache lookup failed for %s (%r); a miss.", request_id, exc)
            op.future = _done(0)
        with self._lock:
            old = self._lookups.pop(op.request_id, None)
            self._lookups[op.request_id] = op
        if old is not None:
            old.release()
        return op

    def poll_lookup(self, lookup: LookupOp) -> int | None:
        """The stored prefix in tokens, ``None`` while pending."""
        return lookup.total_hit if lookup.future.done() else None

    def free_lookup_locks(self, request_id: str, start: int = 0, end: int | None = None) -> None:
        """Release the lookup's leases once they cover nothing a load still needs."""
        with self._lock:
            op = self._lookups.get(str(request_id))
        if op is not None and (end is None or end >= op.total_hit):
            op.release()

    # -- load ------------------------------------------------------------------------------

    def submit_load(
        self,
        lookup: LookupOp,
        device_indices: torch.Tensor,
        *,
        local_hit_tokens: int,
        owned_device_indices: torch.Tensor | None = None,
        producer_stream: Any = None,
    ) -> LoadOp:
        """Copy the leased prefix into the slots after ``local_hit_tokens`` (done on return).

        Raises:
            RuntimeError: the prefix could not be loaded in full (SGLang then prefills it).
        """
        if self.engine is None:
            raise RuntimeError("lmcache is disabled for this SGLang cache")
        slots = owned_device_indices if owned_device_indices is not None else device_indices
        total = lookup.total_hit
        local = int(local_hit_tokens)
        if slots.numel() != total - local:
            raise RuntimeError(
                f"lmcache load for {lookup.request_id}: {slots.numel()} slots for tokens "
                f"[{local}, {total}); expected {total - local}"
            )
        tokens = lookup.token_ids[:total]
        mask = torch.ones(total, dtype=torch.bool)
        mask[: local // self.chunk_size * self.chunk_size] = False
        transfer = TransferSpec(
            self._slot_mapping(total, local, slots).to(self.device), skip_tokens=local
        )
        if self.device.type == "cuda" and producer_stream is not None:
            producer_stream.synchronize()
        if lookup.held is None or lookup.held.released:
            raise RuntimeError(f"lmcache load for {lookup.request_id}: its lookup was released")
        loaded = self.engine.retrieve(tokens, mask, transfer, salt=lookup.salt, held=lookup.held)
        if not bool(loaded[local:total].all()):
            raise RuntimeError(
                f"lmcache load for {lookup.request_id}: {int(loaded[local:total].sum())} of "
                f"{total - local} tokens landed"
            )
        return LoadOp(lookup.request_id, slots, local, _done(True), lookup)

    def prepare_load_on_stream(self, load: LoadOp, stream: Any = None) -> bool:
        """The copy is complete when ``submit_load`` returns: nothing to order."""
        return True

    def ready_prefix_count(self, operations: Sequence[Any]) -> int:
        """How many leading operations are complete."""
        count = 0
        for op in operations:
            if op is None or not op.future.done():
                break
            count += 1
        return count

    def complete_load(self, load: LoadOp, synchronize: bool = True) -> bool:
        if load.lookup is not None:
            load.lookup.release()
        return load.result

    # -- store -----------------------------------------------------------------------------

    def get_store_start(self, request_id: str, num_tokens: int) -> int:
        """Tokens of this request stored already (chunk-aligned)."""
        with self._lock:
            done = self._stored_upto.get(str(request_id), 0)
        return min(done, num_tokens) // self.chunk_size * self.chunk_size

    def submit_store(
        self,
        request_id: str,
        token_ids: Sequence[int],
        device_indices: torch.Tensor,
        *,
        device_indices_start: int = 0,
        cache_salt: str = "",
    ) -> StoreOp | None:
        """Store ``token_ids[device_indices_start:]`` (slots ``device_indices``) asynchronously."""
        if self.engine is None:
            return None
        tokens = list(token_ids)
        start = int(device_indices_start)
        if device_indices.numel() != len(tokens) - start or start % self.chunk_size:
            logger.warning(
                "lmcache store for %s skipped: %d slots for tokens [%d, %d)",
                request_id,
                device_indices.numel(),
                start,
                len(tokens),
            )
            return None
        mask = torch.ones(len(tokens), dtype=torch.bool)
        mask[:start] = False
        transfer = TransferSpec(
            self._slot_mapping(len(tokens), start, device_indices).to(self.device)
        )
        backend = get_backend(self.device)
        backend.stream_synchronize(backend.current_stream(self.device))  # the KV is written
        engine = self.engine

        def run() -> int:
            stored = engine.store(tokens, mask, transfer, salt=cache_salt)
            # Write-through to the disk/remote tiers is queued: wait for it here (off the
            # scheduler thread), so a completed store survives the SGLang process.
            for lower in getattr(engine, "lower_tiers", ()):
                lower.flush(timeout=self.operation_timeout)
            return stored

        with self._lock:
            self._stored_upto[str(request_id)] = len(tokens)
        return StoreOp(str(request_id), len(tokens) - start, self._store_pool.submit(run))

    def complete_store(self, operation: StoreOp, synchronize: bool = True) -> None:
        try:
            operation.future.result(timeout=self.operation_timeout)
        except Exception as exc:
            logger.warning("lmcache store for %s failed (%r); skipped.", operation.request_id, exc)

    # -- lifecycle -------------------------------------------------------------------------

    def finish_request(self, request_id: str) -> None:
        with self._lock:
            op = self._lookups.pop(str(request_id), None)
            self._stored_upto.pop(str(request_id), None)
        if op is not None:
            op.release()

    def end_all_sessions(self) -> None:
        with self._lock:
            ops, self._lookups = list(self._lookups.values()), {}
            self._stored_upto.clear()
        for op in ops:
            op.release()

    def clear(self) -> bool:
        """Drop what this model and rank stored (``clear_storage_backend``)."""
        if self.engine is None:
            return False
        self.engine.clear()
        return True

    def close(self) -> None:
        self.end_all_sessions()
        self._store_pool.shutdown(wait=True)
        if self.engine is not None:
            self.engine.close()
