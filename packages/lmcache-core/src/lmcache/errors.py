# SPDX-License-Identifier: Apache-2.0
"""The exceptions that more than one part of lmcache raises or catches.

They live here, in a module that imports nothing of lmcache, so that any module can use them
without importing the module that first raised them (which is how import loops start).
The modules where each one used to be defined still re-export it, so older import paths work.
"""

from __future__ import annotations

__all__ = [
    "CextUnavailableError",
    "ConfigError",
    "CorruptChunk",
    "KVLayoutError",
    "LeaseError",
    "TierTimeout",
    "TierUnavailable",
]


class ConfigError(ValueError):
    """A configuration key is unknown, has the wrong type, or a bad value."""


class KVLayoutError(ValueError):
    """A KV tensor's shape, dtype, strides or device is not one the connector can handle."""


class LeaseError(RuntimeError):
    """A lease was used after it was released, or released twice."""


class CorruptChunk(ValueError):
    """A stored chunk failed verification (bad header, other key/model/geometry, bad bytes)."""


class TierUnavailable(ConnectionError):
    """The tier is backing off (breaker open, or too many abandoned calls still running): the
    operation was not tried. A miss, counted as a tier error."""


class TierTimeout(TimeoutError):
    """A tier call made no progress within its deadline and was abandoned. A miss, counted as
    a tier timeout (and a tier error)."""


class CextUnavailableError(RuntimeError):
    """``LMCACHE_REQUIRE_CEXT=1`` is set and the CUDA extension cannot be loaded."""
