# SPDX-License-Identifier: Apache-2.0
"""lmcache-vllm: lmcache's KV connector for vLLM 0.32/0.33.

- :mod:`lmcache_vllm.vllm_v1_adapter`: ``LMCacheConnectorV1Impl`` (both connector sides).
- :mod:`lmcache_vllm.connector`: ``LMCacheConnectorV1`` for ``kv_connector_module_path``.
- :mod:`lmcache_vllm.plugin`: ``vllm.general_plugins`` entry point (name ``LMCacheConnector``).
- :mod:`lmcache_vllm.gpu_connector`: ``vllm.cpu`` / ``vllm.cuda`` GPU connectors (no vLLM import).
- :mod:`lmcache_vllm.lookup`: scheduler -> worker lookups over Unix sockets.
- :mod:`lmcache_vllm.utils`: ``get_vllm_torch_dev``, ``calculate_local_rank_and_world_size``.

Importing this package imports neither vLLM nor any submodule.
"""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
