# SPDX-License-Identifier: Apache-2.0
"""Frozen import path of vLLM's in-tree ``LMCacheConnectorV1``.

vLLM's ``vllm/distributed/kv_transfer/kv_connector/v1/lmcache_connector.py`` does
``from lmcache.integration.vllm.vllm_v1_adapter import LMCacheConnectorV1Impl`` and constructs it as
``LMCacheConnectorV1Impl(vllm_config, role, wrapper)``. The implementation lives in the
``lmcache-vllm`` distribution; this module forwards attribute access to
``lmcache_vllm.vllm_v1_adapter`` lazily, and raises ``ImportError`` with the install command when
that package is missing.
"""

from __future__ import annotations

from lmcache.integration._forward import forward_to

__all__ = ["LMCacheConnectorV1Impl"]  # noqa: F822 - provided lazily by __getattr__

__getattr__, __dir__ = forward_to("lmcache_vllm.vllm_v1_adapter", __all__)
