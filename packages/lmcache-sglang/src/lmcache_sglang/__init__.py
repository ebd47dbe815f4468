# SPDX-License-Identifier: Apache-2.0
"""lmcache-sglang: lmcache for SGLang, through SGLang's own cache hooks.

- :mod:`lmcache_sglang.linker`: ``LMCacheLinker``, a ``UnifiedCacheLinker`` (SGLang 0.5.23+,
  ``--unified-cache-external-linker-backend dynamic``): layerwise loads against SGLang's layer
  counter, asynchronous offloads.
- :mod:`lmcache_sglang.hicache_backend`: ``LMCacheHiCacheStorage``, a ``HiCacheStorage``
  backend (``--hicache-storage-backend dynamic``), zero-copy ``batch_get_v1``/``batch_set_v1``
  in every host layout.
- :mod:`lmcache_sglang.mp_connector` / :mod:`lmcache_sglang.mp_metadata`: what SGLang 0.5.21+'s
  ``--enable-lmcache`` imports through ``lmcache.integration.sglang.*``, in process.
- :mod:`lmcache_sglang.legacy_adapter` / :mod:`lmcache_sglang.legacy_stores`: SGLang
  0.5.17-0.5.19's ``--enable-lmcache`` connectors, in process; a store returns before its copy to
  the host, and a lookup of the same prompt waits for it.
- :mod:`lmcache_sglang.gpu_connector`: ``sglang.cpu`` / ``sglang.cuda`` connectors for SGLang's
  K/V and MLA pools (no SGLang import).
- :mod:`lmcache_sglang.page_store`: pages keyed by SGLang's page hash plus model and rank;
  :mod:`lmcache_sglang.kv_pools`: geometry read from SGLang's pools;
  :mod:`lmcache_sglang.hook_config`: configuration shared by the hooks.

Importing this package imports neither SGLang nor any submodule.
"""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
