# SPDX-License-Identifier: Apache-2.0
"""``lmcache.integration.sglang.sglang_adapter``: a path SGLang's ``--enable-lmcache`` imports.

SGLang 0.5.17-0.5.19 ``srt/mem_cache/storage/lmcache/lmc_radix_cache.py`` does ``from
lmcache.integration.sglang.sglang_adapter import LMCacheLayerwiseConnector, LoadMetadata,
StoreMetadata``. The implementation lives in the ``lmcache-sglang`` distribution
(``lmcache_sglang.legacy_adapter``, running in process on lmcache's engine); this module forwards
attribute access to it lazily, and raises ``ImportError`` with the install command when that
package is missing.
"""

from __future__ import annotations

from lmcache.integration._forward import forward_to

__all__ = [  # noqa: F822 - lazy, see __getattr__
    "LMCacheLayerwiseConnector",
    "LoadMetadata",
    "StoreMetadata",
]

__getattr__, __dir__ = forward_to("lmcache_sglang.legacy_adapter", __all__)
