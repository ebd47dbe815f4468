# SPDX-License-Identifier: Apache-2.0
"""Paths SGLang's ``--enable-lmcache`` hook imports (``lmcache.integration.sglang.*``).

SGLang 0.5.21+ (``LMCacheUnifiedRadixCache``) imports ``unified_lmcache_mp_connector`` and
``lmcache_mp_metadata``; SGLang 0.5.17-0.5.19 (``LMCRadixCache``) imports ``sglang_adapter``,
``multi_process_adapter`` and ``utils``. The implementation lives in the ``lmcache-sglang``
distribution: these modules forward attribute access to ``lmcache_sglang`` lazily and raise
``ImportError`` with the install command when that package is missing.
"""
