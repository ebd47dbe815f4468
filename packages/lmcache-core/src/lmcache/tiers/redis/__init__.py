# SPDX-License-Identifier: Apache-2.0
"""The remote tier: chunks in a shared Redis or Valkey server, through redis-py.

- :mod:`~lmcache.tiers.redis.tier`: :class:`~lmcache.tiers.redis.tier.RedisTier`, the key
  names, batched reads and writes.
- :mod:`~lmcache.tiers.redis.client`: the redis-py client behind a circuit breaker.
- :mod:`~lmcache.tiers.redis.url`: parsing and masking of ``remote_url``.

Writes run on the tier's writer thread, reads on its guard threads
(:mod:`lmcache.tiers.lower_tier`). redis-py is imported only when a tier connects.
"""
