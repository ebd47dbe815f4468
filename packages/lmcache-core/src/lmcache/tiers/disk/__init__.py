# SPDX-License-Identifier: Apache-2.0
"""The local disk tier: one file per chunk under a folder, with an LRU byte quota.

- :mod:`~lmcache.tiers.disk.tier`: :class:`~lmcache.tiers.disk.tier.DiskTier`, the index, the
  quota and the eviction order.
- :mod:`~lmcache.tiers.disk.files`: how one chunk lives on disk (names, crash-safe writes, checked
  reads, the scan at start).

Writes run on the tier's writer thread, reads on its guard threads
(:mod:`lmcache.tiers.lower_tier`). Several processes may share one folder.
"""
