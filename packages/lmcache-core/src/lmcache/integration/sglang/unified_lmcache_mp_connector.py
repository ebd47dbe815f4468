# SPDX-License-Identifier: Apache-2.0
"""``lmcache.integration.sglang.unified_lmcache_mp_connector``: a path SGLang's ``--enable-lmcache`` imports.

SGLang 0.5.21+ ``srt/mem_cache/storage/lmcache/lmcache_unified_radix_cache.py`` does ``from
lmcache.integration.sglang.unified_lmcache_mp_connector import UnifiedLMCacheMPConnector``. The
implementation lives in the ``lmcache-sglang`` distribution (``lmcache_sglang.mp_connector``,
running in process on lmcache's engine); this module forwards attribute access to it lazily, and
raises ``ImportError`` with the install command when that package is missing.
"""

from __future__ import annotations

from lmcache.integration._forward import forward_to

__all__ = ["UnifiedLMCacheMPConnector"]  # noqa: F822 - lazy, see __getattr__

__getattr__, __dir__ = forward_to("lmcache_sglang.mp_connector", __all__)
