# SPDX-License-Identifier: Apache-2.0
"""SGLang 0.5.17-0.5.19's ``--enable-lmcache`` (``LMCRadixCache``), run in process.

``LMCRadixCache`` imports, from fixed paths that core keeps as shims forwarding here:

- ``lmcache.integration.sglang.sglang_adapter``: :class:`LMCacheLayerwiseConnector` (its
  in-process mode, chosen on XPU: ``start_load_kv`` then ``load_kv_layerwise(layer)`` from the KV
  pool's per-layer hook), :class:`LoadMetadata`, :class:`StoreMetadata`;
- ``lmcache.integration.sglang.multi_process_adapter``: :class:`LMCacheMPConnector` (its default
  mode on CUDA: ``lookup_kv`` at match, ``retrieve_kv`` at admission). LMCache's version talks to
  a daemon at ``mp_host:mp_port``; this one runs lmcache's engine in the SGLang process and only
  logs that the address is not needed;
- ``lmcache.integration.sglang.utils``: :func:`lmcache_get_config`.

Both connectors key token chunks like ``--enable-lmcache`` on 0.5.21+, by model fingerprint and
rank; ``LMCRadixCache`` passes no request ``extra_key`` or LoRA id on these versions, so with LoRA
adapters enabled every request runs without lmcache (one warning). A hit found by ``lookup_kv``
is leased until it is loaded or released, and any lmcache failure is a miss (0 tokens), never a
request error. Only MHA pools (``k_buffer`` / ``v_buffer``) exist on this
path (``LMCRadixCache`` reads them).

``store_kv`` returns before the host copy of the request's KV completes on a device with streams:
SGLang's later forwards wait only for the gather out of its pools, and a lookup of the same prompt
waits for the publication (:mod:`lmcache_sglang.legacy_stores`).

On CUDA the cache engine keeps the sum the GPU computed of each stored chunk and verifies it on
the GPU at load, by default: a chunk that fails is never written, is dropped, and
``retrieve_kv`` counts only the tokens before it (SGLang computes the rest).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmcache.cache_engine import HeldHit, LayerwiseRetrieve, LMCacheEngine
from lmcache.config import LMCacheConfig
from lmcache.gpu_connector import CreateGPUConnector
from lmcache.gpu_connector.interface import EngineInfo, KVLayoutError, TransferSpec
from lmcache.metadata import LMCacheMetadata
from lmcache.metrics import LMCacheMetrics
from lmcache.model_identity import hf_config_dict, model_digest
from lmcache.tiers import process_cpu_tier
from lmcache_sglang.hook_config import log_start_line
from lmcache_sglang.legacy_stores import DeferredStores
from lmcache_sglang.mp_connector import lmcache_config_for_sglang
from lmcache_sglang.sglang_types import TokenIds

__all__ = [
    "LMCacheLayerwiseConnector",
    "LMCacheMPConnector",
    "LoadMetadata",
    "SGLangLMCacheConfig",
    "StoreMetadata",
    "lmcache_get_config",
]

logger = logging.getLogger(__name__)


@dataclass
class LoadMetadata:
    """A load ``LMCRadixCache`` asks for.

    Attributes:
        token_ids: The request's tokens (at least ``len(slot_mapping)``).
        slot_mapping: ``[num_tokens]`` slots; ``-1`` for tokens SGLang holds already.
        offset: First token to load (chunk-aligned; tokens ``[offset, offset + prefix_pad)`` are
            in SGLang's cache already and are not written).
        prefix_pad: Tokens between ``offset`` and the first uncached token.
        request_id: SGLang's request id (MP mode).
    """

    token_ids: TokenIds
    slot_mapping: torch.Tensor
    offset: int = 0
    prefix_pad: int = 0
    request_id: str | None = None


@dataclass
class StoreMetadata:
    """A store ``LMCRadixCache`` asks for: ``kv_indices`` are the slots of ``token_ids``."""

    last_node: object
    token_ids: TokenIds
    kv_indices: torch.Tensor
    offset: int = 0
    request_id: str | None = None


@dataclass(frozen=True)
class SGLangLMCacheConfig:
    """What :func:`lmcache_get_config` returns: our config, and LMCache's daemon address (which
    ``LMCRadixCache`` reads and this adapter ignores)."""

    config: LMCacheConfig
    config_file: str | None
    mp_host: str = "127.0.0.1"
    mp_port: int = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.config, name)


def lmcache_get_config(config_file: str | None = None) -> SGLangLMCacheConfig:
    """lmcache's config from ``--lmcache-config-file`` (``mp_host``/``mp_port`` accepted).

    Raises:
        ConfigError: a bad file or value.
    """
    host, port = "127.0.0.1", 0
    if config_file:
        import yaml

        try:
            with open(config_file, encoding="utf-8") as f:
                raw = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError):
            raw = {}
        if isinstance(raw, dict):
            host, port = str(raw.get("mp_host", host)), int(raw.get("mp_port", port) or 0)
    config = lmcache_config_for_sglang(config_file or None, log=False)  # the connector logs
    return SGLangLMCacheConfig(config, config_file, host, port)


def _lora_enabled() -> bool:
    """Whether SGLang serves LoRA adapters (0.5.17-0.5.19 pass no adapter id to the connector)."""
    try:
        from sglang.srt.runtime_context import get_server_args

        args = get_server_args()
    except Exception:
        return False
    return bool(getattr(args, "enable_lora", False) or getattr(args, "lora_paths", None))


def _model_name(sgl_config: object) -> str:
    name = str(getattr(sgl_config, "model_path", "") or getattr(sgl_config, "path", "") or "")
    if not name:
        raise KVLayoutError(
            "lmcache (SGLang --enable-lmcache): the model config has no model_path; lmcache keys "
            "every chunk with the model and cannot run without one."
        )
    return name


def _model_digest(sgl_config: object) -> str:
    """:func:`~lmcache.model_identity.model_digest` of SGLang's model config: its effective
    ``hf_config`` and the weights of its folder (or hub snapshot)."""
    return model_digest(
        _model_name(sgl_config),
        config=hf_config_dict(getattr(sgl_config, "hf_config", None)),
        revision=getattr(sgl_config, "revision", None),
    )


class LMCacheLayerwiseConnector:
    """``LMCRadixCache``'s connector, in process on lmcache's engine.

    Args:
        config_file: ``--lmcache-config-file`` (``None``: ``LMCACHE_*`` / ``LMCACHE_CONFIG_FILE``).
        sgl_config: SGLang's ``ModelConfig`` (``model_path``, revision, quantization).
        tp_size: Tensor-parallel size.
        rank: This rank.
        k_pool: Per layer K ``[slots, kv_heads, head_dim]``.
        v_pool: Per layer V ``[slots, kv_heads, v_head_dim]``.
        tp_group: Unused (lookups are rank-local here).

    Raises:
        ConfigError: bad configuration. KVLayoutError: pools lmcache cannot read.
    """

    def __init__(
        self,
        *,
        sgl_config: object,
        tp_size: int,
        rank: int,
        k_pool: Sequence[torch.Tensor],
        v_pool: Sequence[torch.Tensor],
        tp_group: Any = None,
        config_file: str | None = None,
        config: LMCacheConfig | None = None,
        **_: Any,
    ) -> None:
        self.config = config if config is not None else lmcache_config_for_sglang(config_file)
        k0, v0 = k_pool[0], v_pool[0]
        if k0.dim() != 3 or v0.dim() != 3:
            raise KVLayoutError(
                f"lmcache (SGLang --enable-lmcache): K {list(k0.shape)} / V {list(v0.shape)}; "
                "expected per layer [slots, kv_heads, head_dim]"
            )
        metadata = LMCacheMetadata(
            model_name=_model_name(sgl_config),
            world_size=int(tp_size),
            worker_id=int(rank),
            local_worker_id=0,
            local_world_size=1,
            kv_dtype=k0.dtype,
            num_layers=len(k_pool),
            num_kv_heads=int(k0.shape[1]),
            head_size_k=int(k0.shape[2]),
            head_size_v=int(v0.shape[2]),
            chunk_size=self.config.chunk_size,
            model_revision=str(getattr(sgl_config, "revision", None) or ""),
            quantization=str(getattr(sgl_config, "quantization", None) or ""),
            model_digest=_model_digest(sgl_config),
        )
        self.device = k0.device
        info = EngineInfo(
            "sglang", k0.device.type, list(zip(k_pool, v_pool, strict=True)), {"page_size": 1}
        )
        connector = CreateGPUConnector(self.config, metadata, info, {"kv_layout": "token"})
        metrics = LMCacheMetrics(labels={"engine": "sglang", "hook": "lmc_radix_cache"})
        self.engine = LMCacheEngine(
            self.config,
            metadata,
            connector,
            metrics=metrics,
            tier=process_cpu_tier(self.config, metrics),
        )
        self.num_layers = metadata.num_layers
        log_start_line("--enable-lmcache", self.device)
        # LMCRadixCache passes no LoRA id: keys could not tell adapters apart, so never cache.
        self.enabled = not _lora_enabled()
        if not self.enabled:
            logger.warning(
                "lmcache: SGLang serves LoRA adapters, and this SGLang version's --enable-lmcache "
                "passes no adapter id to lmcache; every request runs without lmcache. Use "
                "SGLang 0.5.21+ or the HiCache backend to cache LoRA requests."
            )
        self._stores = DeferredStores(self.engine, self.device, self.config.chunk_size)
        self._held: dict[str, HeldHit] = {}
        self._lock = threading.Lock()
        self._layerwise: LayerwiseRetrieve | None = None
        self._layerwise_next = 0

    # -- shared ----------------------------------------------------------------------------

    def chunk_size(self) -> int:
        return self.config.chunk_size

    def _tokens(self, token_ids: TokenIds, n: int) -> list[int]:
        return [int(t) for t in list(token_ids)[:n]]

    def _load_plan(self, md: LoadMetadata) -> tuple[list[int], torch.Tensor, TransferSpec]:
        n = int(md.slot_mapping.numel())
        valid = (md.slot_mapping >= 0).nonzero()
        first_slot = int(valid[0]) if valid.numel() else n
        # Tokens SGLang holds have slot -1 (IP mode passes no prefix_pad): never write them.
        skip = max(int(md.offset) + int(md.prefix_pad), first_slot)
        mask = torch.ones(n, dtype=torch.bool)
        mask[: int(md.offset)] = False
        transfer = TransferSpec(md.slot_mapping.to(torch.int64), skip_tokens=skip)
        return self._tokens(md.token_ids, n), mask, transfer

    def lookup_kv(self, token_ids: TokenIds, request_id: str | None = None) -> int:
        """Stored prefix in tokens; the hit is leased for ``request_id`` until loaded/released."""
        if not self.enabled:
            return 0
        try:
            tokens = self._tokens(token_ids, len(token_ids))
            self._stores.wait_for(tokens)  # a store of this prompt still in flight
            held = self.engine.lookup_and_lease(tokens)
        except Exception as exc:
            logger.warning("lmcache lookup failed (%r); a miss.", exc)
            return 0
        if request_id is None:
            held.release()
        else:
            self._swap_held(str(request_id), held)
        return int(held.num_tokens)

    def _swap_held(self, rid: str, held: HeldHit | None) -> None:
        with self._lock:
            old = self._held.pop(rid, None)
            if held is not None:
                self._held[rid] = held
        if old is not None and not old.released:
            old.release()

    def release_pending(self, request_id: str) -> None:
        self._swap_held(str(request_id), None)

    def end_session(self, request_id: str) -> None:
        self._swap_held(str(request_id), None)

    def retrieve_kv(self, md: LoadMetadata) -> int:
        """Load tokens from ``md.offset``; returns how many (counted from ``offset``)."""
        rid = str(md.request_id) if md.request_id is not None else None
        with self._lock:
            held = self._held.get(rid) if rid is not None else None
        try:
            tokens, mask, transfer = self._load_plan(md)
            loaded = self.engine.retrieve(tokens, mask, transfer, held=held)[int(md.offset) :]
            # a chunk that failed its checksum at load is a hole: count only what precedes it
            holes = (~loaded).nonzero()
            return int(holes[0]) if holes.numel() else int(loaded.numel())
        except Exception as exc:
            logger.warning("lmcache retrieve failed (%r); a miss.", exc)
            return 0
        finally:
            if rid is not None:
                self._swap_held(rid, None)

    def start_load_kv(self, md: LoadMetadata) -> int:
        """Start a layerwise load (``load_kv_layerwise`` copies each layer); returns the tokens
        it will load, counted from ``md.offset``."""
        self._finish_layerwise()
        if not self.enabled:
            return 0
        try:
            tokens, mask, transfer = self._load_plan(md)
            self._stores.wait_for(tokens)  # a store of this prompt still in flight
            retrieve = self.engine.retrieve_layerwise(tokens, mask, transfer)
        except Exception as exc:
            logger.warning("lmcache layerwise load failed to start (%r); a miss.", exc)
            return 0
        if retrieve.num_hit_tokens == 0:
            retrieve.abort()
            return 0
        self._layerwise, self._layerwise_next = retrieve, 0
        return retrieve.num_hit_tokens

    def load_kv_layerwise(self, layer_id: int) -> None:
        """SGLang's per-layer hook: copy the pending load's layers up to ``layer_id``."""
        retrieve = self._layerwise
        if retrieve is None:
            return
        try:
            if layer_id >= self._layerwise_next:
                stop = min(layer_id + 1, self.num_layers)
                retrieve.load_layers(stop)
                self._layerwise_next = stop
            if layer_id + 1 >= self.num_layers:
                self._finish_layerwise()
        except Exception as exc:
            logger.warning("lmcache layerwise load failed at layer %d (%r).", layer_id, exc)
            self._layerwise = None

    def _finish_layerwise(self) -> None:
        retrieve, self._layerwise = self._layerwise, None
        if retrieve is None:
            return
        try:
            if self._layerwise_next < self.num_layers:
                retrieve.load_layers(self.num_layers)
            retrieve.finish()
        except Exception as exc:
            logger.warning("lmcache layerwise load failed (%r).", exc)
            retrieve.abort()

    def store_kv(self, md: StoreMetadata) -> int:
        """Store the request's KV (chunks stored already are skipped); returns the tokens it
        will publish. With streams the copy finishes after the return (:mod:`.legacy_stores`)."""
        if not self.enabled:
            return 0
        try:
            n = int(md.kv_indices.numel())
            return self._stores.store(self._tokens(md.token_ids, n), md.kv_indices)
        except Exception as exc:
            logger.warning("lmcache store failed (%r); skipped.", exc)
            return 0

    def close(self) -> None:
        with self._lock:
            held, self._held = list(self._held.values()), {}
        for h in held:
            if not h.released:
                h.release()
        self._stores.close()
        self.engine.close()


class LMCacheMPConnector(LMCacheLayerwiseConnector):
    """``LMCRadixCache``'s multi-process connector, run in process (no daemon).

    Takes ``page_size``, ``host`` and ``port`` (LMCache's daemon address: ignored, and the config
    file's ``mp_host``/``mp_port`` are logged once as not needed) besides the layerwise
    connector's arguments; the config comes from SGLang's ``--lmcache-config-file`` (read from
    SGLang's runtime context), else ``LMCACHE_CONFIG_FILE`` / ``LMCACHE_*``.
    """

    def __init__(
        self,
        *,
        page_size: int = 1,
        host: str | None = None,
        port: int | None = None,
        **kwargs: Any,
    ) -> None:
        config_file = kwargs.pop("config_file", None)
        if config_file is None:
            try:
                from sglang.srt.runtime_context import get_memory

                config_file = get_memory().lmcache_config_file or None
            except Exception:
                config_file = None
        super().__init__(config_file=config_file, **kwargs)
        self.page_size = int(page_size)
