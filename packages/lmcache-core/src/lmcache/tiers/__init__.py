# SPDX-License-Identifier: Apache-2.0
"""Storage tiers for KV chunks: CPU (pinned host memory), local disk, Redis/Valkey.

:class:`CPUTier` holds chunks in host memory; :class:`~lmcache.tiers.lower_tier.LowerTier` is
the contract of the tiers below it (the subpackages :mod:`lmcache.tiers.disk` and
:mod:`lmcache.tiers.redis`), which store :mod:`lmcache.tiers.chunk_format` entries. The
process-wide instances come from :func:`process_cpu_tier` and :func:`process_lower_tiers`.
"""

from __future__ import annotations

from lmcache.tiers.cpu_tier import CHECKSUM_SLICE_BYTES, CPUTier, tensor_checksum
from lmcache.tiers.lower_tier import LowerTier, ReadRequest
from lmcache.tiers.process_tier import (
    process_cpu_tier,
    process_lower_tiers,
    reset_process_cpu_tiers,
)

__all__ = [
    "CHECKSUM_SLICE_BYTES",
    "CPUTier",
    "LowerTier",
    "ReadRequest",
    "process_cpu_tier",
    "process_lower_tiers",
    "reset_process_cpu_tiers",
    "tensor_checksum",
]
