# SPDX-License-Identifier: Apache-2.0
"""The parts of :class:`lmcache.cache_engine.LMCacheEngine`, one responsibility each.

Users import the engine, its hits and the objects it returns from :mod:`lmcache.cache_engine`;
nothing here is a public path.
Everything runs on the caller's thread: the serving engine's worker, its save or commit thread,
or a lookup thread. No module here imports :mod:`lmcache.cache_engine`.

- :mod:`~lmcache.engine.setup`: construction, the host budget check, the connector, planning.
- :mod:`~lmcache.engine.tiers`: the tier stack, metrics and chunk shape the parts share.
- :mod:`~lmcache.engine.request_plan`: a request validated once and cut into keyed chunks.
- :mod:`~lmcache.engine.hits`: finding and leasing the stored prefix of a request.
- :mod:`~lmcache.engine.held_hit`: a leased lookup hit, held until the caller lets go.
- :mod:`~lmcache.engine.stores`: leasing buffers for a store and publishing them.
- :mod:`~lmcache.engine.store_plan`: planned, staged and batched stores.
- :mod:`~lmcache.engine.layerwise`: layerwise stores and retrieves, driven one layer at a time.
- :mod:`~lmcache.engine.load_checks`: what a load's checksums say of its chunks.
- :mod:`~lmcache.engine.chunk_moves`: a chunk being moved, and the protocols to the engine.
"""
