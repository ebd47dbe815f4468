# SPDX-License-Identifier: Apache-2.0
"""Host memory for KV chunks: a budgeted (pinned) pool that hands out explicit leases."""

from __future__ import annotations

from lmcache.memory.pinned_pool import (
    ALIGNMENT,
    HostMemoryPool,
    LeaseError,
    MemoryLease,
    aligned_bytes,
)

__all__ = ["ALIGNMENT", "HostMemoryPool", "LeaseError", "MemoryLease", "aligned_bytes"]
