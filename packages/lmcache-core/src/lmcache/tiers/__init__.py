# SPDX-License-Identifier: Apache-2.0
"""Storage tiers for KV chunks (CPU now; local disk and remote later)."""

from __future__ import annotations

from lmcache.tiers.cpu_tier import CHECKSUM_SLICE_BYTES, CPUTier, tensor_checksum
from lmcache.tiers.process_tier import process_cpu_tier, reset_process_cpu_tiers

__all__ = [
    "CHECKSUM_SLICE_BYTES",
    "CPUTier",
    "process_cpu_tier",
    "reset_process_cpu_tiers",
    "tensor_checksum",
]
