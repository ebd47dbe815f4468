# SPDX-License-Identifier: Apache-2.0
"""lmcache-vllm: lmcache's KV connector for vLLM 0.26-0.33.

The wiring at the top:

- :mod:`lmcache_vllm.connector`: ``LMCacheConnectorV1`` for ``kv_connector_module_path``.
- :mod:`lmcache_vllm.vllm_v1_adapter`: ``LMCacheConnectorV1Impl``, the object vLLM's in-tree
  wrapper builds. It holds a scheduler side or a worker side.
- :mod:`lmcache_vllm.in_tree`: the hooks vLLM's in-tree wrapper does not forward.
- :mod:`lmcache_vllm.plugin`: the ``vllm.general_plugins`` entry point.
- :mod:`lmcache_vllm.gpu_connector`: the ``vllm.cpu`` / ``vllm.cuda`` entry points of
  ``lmcache.gpu_connectors``.

What both sides share: :mod:`lmcache_vllm.connector_metadata` (the plain data pickled from the
scheduler to the workers), :mod:`lmcache_vllm.lookup_wire` and :mod:`lmcache_vllm.lookup_sockets`
(the lookups between them), :mod:`lmcache_vllm.extra_config`, :mod:`lmcache_vllm.vllm_types` (the
parts of vLLM's objects we read) and :mod:`lmcache_vllm.utils`.

The subpackages, by the process they run in:

- :mod:`lmcache_vllm.scheduler`: what to load and save per request, in the engine-core process.
- :mod:`lmcache_vllm.worker`: loads, saves and leased lookup hits, in each worker process.
- :mod:`lmcache_vllm.transfer`: the copies between vLLM's pages and lmcache's chunk buffers.

Importing this package imports neither vLLM nor any submodule.
"""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
