# SPDX-License-Identifier: Apache-2.0
"""Hybrid KV caches on real vLLM with CUDA and vLLM's hybrid KV cache manager on: a Gemma-3
text model (5 sliding layers per full one), a model that alternates sliding and full layers
(gpt-oss's layout, built as Gemma-3), and Nemotron-H (Mamba-2 and attention), with vLLM's
prefix cache off and in its Mamba prefix-caching mode.

Each test compares greedy tokens with vLLM without lmcache, token for token, and counts the
hit after vLLM's own prefix cache is reset. Hits with several KV cache groups need a vLLM with
``failed_recving`` (0.32 and later); on an older one (the GPU bundle's 0.26) lmcache stores the
prompts and loads nothing, and the tests check that instead. Mamba hits also need vLLM's state
offers (``boundary_state_offloads``, 0.32 and later).
"""

from __future__ import annotations

from typing import Any

import pytest

from lmcache_vllm.testing import build_tiny_gemma3, build_tiny_nemotron_h

# skips this module without a CUDA GPU, and sets vLLM's environment for in-process engines
from .test_real_vllm_cuda import PROMPT, _gen, _llm, _shutdown

pytestmark = pytest.mark.gpu

CHUNK, WINDOW = 256, 64
KV: dict[str, Any] = {
    "kv_connector": "LMCacheConnectorV1",
    "kv_connector_module_path": "lmcache_vllm.connector",  # our class: SupportsHMA
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"lmcache.chunk_size": CHUNK},
}
LAYOUTS = {
    "gemma3": ("sliding_attention",) * 5 + ("full_attention",),
    "alternating": ("sliding_attention", "full_attention") * 3,
}


def _hybrid_hits() -> bool:
    """Whether this vLLM can be told per request that a load failed (hits with several
    groups)."""
    from lmcache_vllm.connector import FAILED_RECVING

    return bool(FAILED_RECVING)


def _stored_chunks() -> int:
    from lmcache_vllm.vllm_v1_adapter import live_engines

    engines = live_engines()
    return len(engines[0].tier) if engines else 0


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sliding_window_model_with_the_hybrid_manager_on(tmp_path, layout):
    model = build_tiny_gemma3(tmp_path / layout, sliding_window=WINDOW, layer_types=LAYOUTS[layout])
    ref = _llm(model, None, enable_prefix_caching=False)
    try:
        ((want, _),) = _gen(ref, [PROMPT])
    finally:
        _shutdown(ref)
    llm = _llm(model, KV)
    try:
        assert llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
        assert _gen(llm, [PROMPT]) == [(want, 0)]
        assert _stored_chunks() > 0
        assert llm.reset_prefix_cache()
        assert _gen(llm, [PROMPT]) == [(want, 512 if _hybrid_hits() else 0)]
    finally:
        _shutdown(llm)


def _state_offers() -> bool:
    """Whether this vLLM offers Mamba states to connectors (it then has a retention interval)."""
    from vllm.config import CacheConfig

    return "prefix_cache_retention_interval" in getattr(CacheConfig, "__dataclass_fields__", {})


MAMBA_ALIGN: dict[str, Any] = {"enable_prefix_caching": True, "mamba_cache_mode": "align"}


@pytest.mark.parametrize("mode", ["prefix-cache-off", "mamba-align"])
def test_mamba_hybrid_serves_with_lmcache(tmp_path, mode):
    model = build_tiny_nemotron_h(tmp_path / "nemotron-h")
    engine = dict(MAMBA_ALIGN) if mode == "mamba-align" else {"enable_prefix_caching": False}
    if mode == "mamba-align" and _state_offers():
        engine["prefix_cache_retention_interval"] = CHUNK  # a state at every chunk boundary
    ref = _llm(model, None, enable_prefix_caching=False, block_size=None)
    try:
        ((want, _),) = _gen(ref, [PROMPT])
    finally:
        _shutdown(ref)
    llm = _llm(model, KV, block_size=None, **engine)
    try:
        assert llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
        assert _gen(llm, [PROMPT]) == [(want, 0)]
        ((again, own),) = _gen(llm, [PROMPT])
        assert again == want and (own > 0) == (mode == "mamba-align")  # vLLM's own cache
        assert llm.reset_prefix_cache()
        ((tokens, cached),) = _gen(llm, [PROMPT])
        assert tokens == want
        if mode == "mamba-align" and _hybrid_hits() and _state_offers():
            assert cached > 0  # from lmcache: vLLM's own cache was reset
        else:
            assert cached == 0 and _stored_chunks() == 0  # lmcache inert for this engine
    finally:
        _shutdown(llm)
