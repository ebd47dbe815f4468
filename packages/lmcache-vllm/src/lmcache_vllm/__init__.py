# SPDX-License-Identifier: Apache-2.0
"""lmcache-vllm: lmcache's KV connector for vLLM 0.26-0.33.

- :mod:`lmcache_vllm.vllm_v1_adapter`: ``LMCacheConnectorV1Impl``, the object vLLM's in-tree
  wrapper builds; it holds one of
- :mod:`lmcache_vllm.scheduler.side` (what to load and save per request; never raises into vLLM) and
- :mod:`lmcache_vllm.worker.side` (loads, asynchronous saves, leased lookup hits), over the plain data
  of :mod:`lmcache_vllm.connector_metadata`.
- :mod:`lmcache_vllm.scheduler.request_keys`: what of a request besides its tokens enters the chunk keys
  (cache salt, LoRA adapter, multimodal items; prompt embeddings are not cached).
- :mod:`lmcache_vllm.connector`: ``LMCacheConnectorV1`` for ``kv_connector_module_path``.
- :mod:`lmcache_vllm.plugin`: ``vllm.general_plugins`` entry point (name ``LMCacheConnector``);
  :mod:`lmcache_vllm.in_tree` gives vLLM's in-tree wrapper the hooks it does not forward.
- :mod:`lmcache_vllm.gpu_connector`: ``vllm.cpu`` / ``vllm.cuda`` GPU connectors (no vLLM import).
- :mod:`lmcache_vllm.worker.lookup_server`: scheduler -> worker lookups over Unix sockets (wire format in
  :mod:`lmcache_vllm.lookup_wire`).
- :mod:`lmcache_vllm.worker.save_queue`, :mod:`lmcache_vllm.worker.lookup_leases`: saves off the step, leases.
- :mod:`lmcache_vllm.utils`: ``get_vllm_torch_dev``, ``calculate_local_rank_and_world_size``.

Importing this package imports neither vLLM nor any submodule.
"""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
