# SPDX-License-Identifier: Apache-2.0
"""What vLLM's registered KV caches say about the model: layer order, geometry, fingerprint.

:func:`order_caches` puts vLLM's ``{layer name: cache}`` in layer order; :func:`build_metadata`
reads the geometry from the real tensors (shape and dtype, never assumed) and every
configuration fact that changes the KV bytes (model, revision, quantization, KV-cache dtype,
tensor-parallel rank, and a digest of the effective model configuration and of the weights,
:func:`lmcache.model_identity.model_digest`) into :class:`~lmcache.metadata.LMCacheMetadata`, whose
fingerprint seeds every chunk key; with several KV cache groups each group's engine adds its
group to it (``group_tag``, :func:`lmcache_vllm.kv_groups.group_tag`).
:func:`check_kv_cache_groups` refuses a KV cache of several groups (vLLM's hybrid KV cache
manager) for vLLM's in-tree wrapper, which does not pass each group's blocks on.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from lmcache.cache_engine import LMCacheEngine
from lmcache.config import LMCacheConfig
from lmcache.gpu_connector import CreateGPUConnector, EngineInfo, KVLayoutError
from lmcache.metadata import LMCacheMetadata
from lmcache.metrics import LMCacheMetrics
from lmcache.model_identity import hf_config_dict, model_digest
from lmcache.tiers import process_cpu_tier
from lmcache_vllm.transfer.cpu_layout_probe import probe_cpu_kv_format
from lmcache_vllm.utils import calculate_local_rank_and_world_size

if TYPE_CHECKING:
    from lmcache_vllm.vllm_types import KVCacheConfig

__all__ = [
    "build_engine",
    "build_metadata",
    "check_kv_cache_groups",
    "order_caches",
    "vllm_model_digest",
]

logger = logging.getLogger(__name__)


def _layer_index(name: str, fallback: int) -> int:
    try:
        from vllm.model_executor.models.utils import extract_layer_index

        return int(extract_layer_index(name))
    except Exception:
        return fallback


def check_kv_cache_groups(kv_cache_config: KVCacheConfig | None, *, supports_hma: bool) -> None:
    """Refuse several KV cache groups (vLLM's hybrid KV cache manager) where the connector
    class that vLLM built does not take each group's blocks.

    Our class (``kv_connector`` ``LMCacheConnector``, or the module path
    ``lmcache_vllm.connector``) implements vLLM's ``SupportsHMA`` and takes them. vLLM's
    in-tree wrapper (``LMCacheConnectorV1`` without a module path) does not: vLLM turns its
    hybrid manager off for it, and refuses it when the manager is forced on. Were it on anyway,
    lmcache would move every layer through group 0's block table and load wrong KV.

    Raises:
        ValueError: more than one group and ``supports_hma`` false, with the fix.
    """
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if len(groups) <= 1 or supports_hma:
        return
    kinds = sorted({type(getattr(g, "kv_cache_spec", None)).__name__ for g in groups})
    raise ValueError(
        f"lmcache: this engine's KV cache has {len(groups)} groups ({', '.join(kinds)}), "
        "because vLLM's hybrid KV cache manager is on, and vLLM's in-tree LMCacheConnectorV1 "
        "wrapper does not pass each group's blocks on. Select lmcache's own connector class, "
        "which supports the hybrid manager: --kv-transfer-config "
        '\'{"kv_connector":"LMCacheConnector","kv_role":"kv_both"}\' (or '
        '"kv_connector_module_path":"lmcache_vllm.connector"), or start vLLM with '
        "--disable-hybrid-kv-cache-manager."
    )


def order_caches(kv_caches: dict[str, torch.Tensor]) -> tuple[list[str], list[torch.Tensor]]:
    """Layer names and caches in layer order.

    Raises:
        KVLayoutError: vLLM registered no caches.
    """
    if not kv_caches:
        raise KVLayoutError("vLLM registered no KV caches with the lmcache connector")
    names = list(kv_caches)
    order = sorted(range(len(names)), key=lambda i: (_layer_index(names[i], i), i))
    names = [names[i] for i in order]
    return names, [kv_caches[n] for n in names]


def vllm_model_digest(model_config: Any) -> str:
    """:func:`~lmcache.model_identity.model_digest` of vLLM's model: its effective Hugging Face
    configuration (``hf_config``, after ``hf_overrides``) and its weights (a local folder's
    files, or the hub snapshot's commit). ``""`` (keys by name, revision and geometry only) when
    vLLM's config cannot be read, logged."""
    mc = model_config
    try:
        cfg = hf_config_dict(getattr(mc, "hf_config", None))
        return model_digest(str(mc.model), config=cfg, revision=getattr(mc, "revision", None))
    except Exception as e:
        logger.warning(
            "lmcache: cannot digest the configuration and weights of %s (%s: %s); chunk keys "
            "cover its name, revision and geometry only",
            getattr(mc, "model", "?"),
            type(e).__name__,
            e,
        )
        return ""


def build_metadata(
    vllm_config: Any,
    names: list[str],
    caches: list[torch.Tensor],
    *,
    chunk_size: int,
    world_size: int,
    rank: int,
    group_tag: str = "",
) -> tuple[LMCacheMetadata, dict[str, Any]]:
    """The metadata and connector layout hints of vLLM's caches ``[num_blocks, kv_heads,
    block_size, head_k + head_v]`` per layer (MLA: ``[num_blocks, block_size, latent]``).

    ``group_tag`` (one of several KV cache groups) goes into the fingerprint, after the model
    digest, so each group's chunks have keys of their own.

    Raises:
        KVLayoutError: a cache that is not one of those views.
    """
    vc = vllm_config
    mc = vc.model_config
    first = caches[0]
    use_mla = bool(getattr(mc, "use_mla", False))
    if use_mla:
        heads, hk, hv = 1, int(first.shape[-1]), 0
    else:
        if first.dim() != 4:
            raise KVLayoutError(
                f"vLLM KV cache {tuple(first.shape)} strides {tuple(first.stride())}: expected "
                "the per-layer view [num_blocks, kv_heads, block_size, head_k + head_v]"
            )
        heads = int(first.shape[1])
        hk = int(mc.get_head_size())
        hv = int(first.shape[3]) - hk
    cache_dtype = str(getattr(vc.cache_config, "cache_dtype", "auto") or "auto")
    kv_cache_dtype = "" if cache_dtype == "auto" else f"{cache_dtype}/{getattr(mc, 'dtype', '')}"
    local_rank, local_world = calculate_local_rank_and_world_size(vc)
    metadata = LMCacheMetadata(
        model_name=str(mc.model),
        world_size=world_size,
        worker_id=rank,
        local_worker_id=local_rank,
        local_world_size=local_world,
        kv_dtype=first.dtype,
        num_layers=len(caches),
        num_kv_heads=heads,
        head_size_k=hk,
        head_size_v=hv,
        use_mla=use_mla,
        chunk_size=chunk_size,
        model_revision=str(getattr(mc, "revision", None) or ""),
        quantization=str(getattr(mc, "quantization", None) or ""),
        kv_cache_dtype=kv_cache_dtype,
        model_digest=vllm_model_digest(mc) + (f"|{group_tag}" if group_tag else ""),
    )
    hints: dict[str, Any] = {}
    if use_mla:
        hints["kv_format"] = "mla"
    elif first.device.type == "cpu":
        hints["kv_format"] = probe_cpu_kv_format(vc, names, first)
    return metadata, hints


def build_engine(
    vllm_config: Any,
    config: LMCacheConfig,
    names: list[str],
    caches: list[torch.Tensor],
    *,
    world_size: int,
    rank: int,
    labels: dict[str, str],
    block_size: int | None = None,
    group_tag: str = "",
) -> tuple[LMCacheEngine, str]:
    """The cache engine for vLLM's caches (in layer order): metadata, the ``vllm.<device>``
    connector, labelled metrics, the process-wide CPU tier. Returns it and the block format.
    ``block_size`` (default vLLM's ``cache_config.block_size``) and ``group_tag`` for one of
    several KV cache groups.

    Raises:
        KVLayoutError: a layout no connector handles.
    """
    metadata, hints = build_metadata(
        vllm_config,
        names,
        caches,
        chunk_size=config.chunk_size,
        world_size=world_size,
        rank=rank,
        group_tag=group_tag,
    )
    if block_size is None:
        block_size = int(vllm_config.cache_config.block_size)
    info = EngineInfo(
        name="vllm",
        device=caches[0].device.type,
        kv_caches=caches,
        extra={"block_size": block_size},
    )
    connector = CreateGPUConnector(config, metadata, info, hints)
    metrics = LMCacheMetrics(labels=labels)
    engine = LMCacheEngine(
        config, metadata, connector, metrics=metrics, tier=process_cpu_tier(config, metrics)
    )
    return engine, str(hints.get("kv_format", getattr(connector, "kv_format", "default")))
