# SPDX-License-Identifier: Apache-2.0
"""lmcache adapter for SGLang (skeleton).

This package will hold SGLang's integration with lmcache: GPU connectors for SGLang's per-layer
K/V pools (``[slots, heads, head_dim]`` each, MLA one latent buffer) registered under the
``sglang.cuda`` / ``sglang.cpu`` keys, a ``UnifiedCacheLinker``, a ``HiCacheStorage`` backend and
the ``lmcache.integration.sglang.*`` paths SGLang's ``--enable-lmcache`` hook imports.

Nothing is registered yet: it declares no entry point until working code stands behind it.
"""

from __future__ import annotations

__all__: list[str] = []
