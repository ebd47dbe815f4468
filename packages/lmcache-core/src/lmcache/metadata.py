# SPDX-License-Identifier: Apache-2.0
"""Model and KV-cache geometry that every chunk of a cache instance shares.

:class:`LMCacheMetadata` is filled by an adapter from the engine's config and real KV tensors. Its
:meth:`~LMCacheMetadata.fingerprint` seeds every chunk key, so two caches only share chunks when
every fact that changes the bytes is the same.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

__all__ = ["LMCacheMetadata"]


@dataclass(frozen=True)
class LMCacheMetadata:
    """Facts about the model and this worker that determine KV bytes.

    Attributes:
        model_name: Model identifier (path or hub id) as the engine names it.
        world_size: Tensor-parallel world size of the KV shards (each rank stores its shard).
        worker_id: This worker's tensor-parallel rank, ``0 <= worker_id < world_size``.
        local_worker_id: Rank within this node (selects the local device).
        local_world_size: Workers on this node.
        kv_dtype: Element dtype of the KV cache.
        num_layers: Attention layers whose KV is cached.
        num_kv_heads: KV heads held by this worker (its shard); 1 for MLA.
        head_size_k: Elements per K head (the latent size for MLA).
        head_size_v: Elements per V head (0 for MLA).
        use_mla: Multi-head latent attention: one latent vector per token per layer.
        chunk_size: Tokens per chunk.
        model_revision: Revision of the model weights (e.g. a hub commit hash); ``""`` when
            unknown. Different weights give different KV for the same tokens.
        quantization: Weight quantization method as the engine names it (e.g. ``"awq"``,
            ``"fp8"``); ``""`` for none.
        kv_cache_dtype: The engine's KV-cache dtype setting (e.g. ``"fp8_e4m3"``); ``""`` for
            the engine's default (vLLM's ``"auto"``). Two settings may store the same
            ``kv_dtype`` element type with different scaling, so the setting is a fact of its own.
        model_digest: What the model name stands for beyond its name: a digest of the engine's
            effective model configuration and of the weights (a local folder's files, or a hub
            snapshot's commit; :func:`lmcache.model_identity.model_digest`); ``""`` when
            unknown. A folder rebuilt in place, or the same model started with other
            configuration overrides, gets other keys.
    """

    model_name: str
    world_size: int
    worker_id: int
    local_worker_id: int
    local_world_size: int
    kv_dtype: torch.dtype
    num_layers: int
    num_kv_heads: int
    head_size_k: int
    head_size_v: int
    use_mla: bool = False
    chunk_size: int = 256
    model_revision: str = ""
    quantization: str = ""
    kv_cache_dtype: str = ""
    model_digest: str = ""

    def __post_init__(self) -> None:
        problems = []
        if not 0 <= self.worker_id < self.world_size:
            problems.append(
                f"worker_id={self.worker_id} must be in [0, world_size={self.world_size})"
            )
        if not 0 <= self.local_worker_id < max(self.local_world_size, 1):
            problems.append(
                f"local_worker_id={self.local_worker_id} must be in "
                f"[0, local_world_size={self.local_world_size})"
            )
        for name in ("num_layers", "num_kv_heads", "head_size_k", "chunk_size"):
            if getattr(self, name) <= 0:
                problems.append(f"{name}={getattr(self, name)} must be > 0")
        if self.use_mla and self.head_size_v != 0:
            problems.append(f"use_mla=True needs head_size_v=0, found {self.head_size_v}")
        if not self.use_mla and self.head_size_v <= 0:
            problems.append(f"head_size_v={self.head_size_v} must be > 0 unless use_mla")
        for name in ("model_revision", "quantization", "kv_cache_dtype", "model_digest"):
            if not isinstance(getattr(self, name), str):
                problems.append(
                    f'{name}={getattr(self, name)!r} must be a str ("" when not applicable)'
                )
        if problems:
            raise ValueError("Invalid LMCacheMetadata: " + "; ".join(problems))

    @property
    def kv_width(self) -> int:
        """Elements per token per layer in the canonical chunk format ``[layers, tokens, width]``."""
        if self.use_mla:
            return self.head_size_k
        return self.num_kv_heads * (self.head_size_k + self.head_size_v)

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one full chunk."""
        itemsize = torch.empty((), dtype=self.kv_dtype).element_size()
        return self.num_layers * self.chunk_size * self.kv_width * itemsize

    def fingerprint(self) -> bytes:
        """Canonical bytes of every fact that changes the KV bytes of a chunk.

        Includes the model, geometry, dtype, chunk size and tensor-parallel rank/size, and
        ``model_revision``, ``quantization``, ``kv_cache_dtype`` and ``model_digest`` when they
        are non-empty (so fingerprints, and keys, of metadata without them are those of format
        ``lmcache-kv-v1`` before these fields existed); excludes the local (per-node) placement, which does not
        change the bytes.

        Returns:
            Compact JSON with sorted keys, UTF-8 encoded.
        """
        facts: dict[str, object] = {
            "format": "lmcache-kv-v1",
            "model_name": self.model_name,
            "world_size": self.world_size,
            "worker_id": self.worker_id,
            "kv_dtype": str(self.kv_dtype).removeprefix("torch."),
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_size_k": self.head_size_k,
            "head_size_v": self.head_size_v,
            "use_mla": self.use_mla,
            "chunk_size": self.chunk_size,
        }
        for name in ("model_revision", "quantization", "kv_cache_dtype", "model_digest"):
            value = getattr(self, name)
            if value:
                facts[name] = value
        return json.dumps(facts, sort_keys=True, separators=(",", ":")).encode()
