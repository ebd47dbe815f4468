# SPDX-License-Identifier: Apache-2.0
"""The node cache: one host cache per machine, shared by every engine process on it.

- :mod:`~lmcache.node.wire`: the messages and their framing (msgspec, msgpack; no pickle).
- :mod:`~lmcache.node.arena`: the shared memory file, its folder and their permissions.
- :mod:`~lmcache.node.index`: the owner's entries, blocks, leases and eviction order.
- :mod:`~lmcache.node.server`: the owner process (``python -m lmcache.node serve``).
- :mod:`~lmcache.node.client`: the engine side; :class:`lmcache.tiers.node_tier.NodeTier` is
  the tier built on it.

Importing this package (and the owner's modules) loads no torch. ``docs/node_cache.md``
explains the design.
"""
