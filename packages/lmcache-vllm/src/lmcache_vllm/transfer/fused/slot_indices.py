# SPDX-License-Identifier: Apache-2.0
"""The slot indices of :class:`~lmcache_vllm.transfer.fused.transfer.FusedTransfer`'s gathers and
scatters.

:class:`SlotIndices` turns a call's slot mapping into the device index tensor of its staging
tokens (slots, or ``(block, offset)`` pairs), checking every slot: a host slot mapping on the host
before anything is queued, its indices uploaded through a ring of persistent pinned buffers
(:class:`~lmcache.devices.UploadRing`: no allocation, no device sync); a device slot mapping on the device, answered through one pinned pair that the
call reads back. Every pinned buffer, event and copy goes through the device backend. This module
never imports vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lmcache.devices import UploadRing
from lmcache.gpu_connector.interface import TransferSpec
from lmcache_vllm.transfer.fused.plan import StagingPlan
from lmcache_vllm.transfer.paged_cache import PagedKVCache

if TYPE_CHECKING:
    from lmcache.devices import DeviceBackend

__all__ = ["SlotIndices"]


class SlotIndices:
    """Builds and checks the index tensors of the fused path (see the module docstring).

    Args:
        cache: The paged cache (block size, block count, slot checks, device).
        backend: The cache device's backend.
        by_slot: Whether the fused views index tokens by slot (``[1, total]``), else by
            ``(block, offset)`` (``[2, total]``).
    """

    def __init__(self, cache: PagedKVCache, backend: DeviceBackend, by_slot: bool) -> None:
        self.cache = cache
        self.backend = backend
        self.device = cache.device
        self.block_size = cache.block_size
        self.num_blocks = cache.num_blocks
        self.by_slot = by_slot
        # Persistent pinned host buffers (CUDA): index uploads.
        self.uploads = UploadRing(backend, cache.device)

    def build(self, plan: StagingPlan, transfer: TransferSpec) -> tuple[torch.Tensor, Any]:
        """``(indices, check)``: ``[1, total]`` slots or ``[2, total]`` (block, offset) of the
        staging tokens, int64 on the device (``[1, total]`` when :attr:`by_slot`).

        A host slot mapping is checked here, before anything is queued, and its indices go to
        the device in one pinned copy (no sync). A device slot mapping is checked on the device:
        ``check()`` raises ``ValueError`` for a bad slot once the device has answered (call it
        before trusting a scatter); until then slots are clamped so no access goes out of bounds.
        """
        sm = transfer.slot_mapping
        if len(plan.tokens) == 1:
            a, b = plan.tokens[0]
            slots = sm[a:b]
        else:
            slots = sm[plan.token_ids().to(sm.device)]
        bs, limit = self.block_size, self.num_blocks * self.block_size
        if len(plan.kept) == 1 and plan.kept[0] == (0, plan.total):
            kept_pos: Any = None
        elif len(plan.kept) == 1:
            kept_pos = slice(*plan.kept[0])
        else:
            kept_pos = plan.kept_positions()

        def token_ids() -> torch.Tensor:
            ids = plan.token_ids()
            return ids if kept_pos is None else ids[kept_pos]

        rows = 1 if self.by_slot else 2
        if slots.device.type == "cpu" or self.device.type == "cpu":
            slots = slots.to("cpu", torch.int64)
            self.cache.check_slots(slots if kept_pos is None else slots[kept_pos], token_ids)
            idx = torch.empty((rows, plan.total), dtype=torch.int64)
            self._fill_indices(idx, slots)
            if not self.backend.has_streams:
                return idx, lambda: None
            return self.uploads.upload(idx), lambda: None
        slots = slots.to(self.device, torch.int64)
        on_dev = kept_pos.to(self.device) if isinstance(kept_pos, torch.Tensor) else kept_pos
        kept = slots if on_dev is None else slots[on_dev]
        # A buffer per call: a store and a load build on different threads, and each call's
        # check() may run after another call's copy. torch's copy records the stream, so its
        # pinned allocator hands the block out again only after the copy has landed.
        lo_hi = self._pinned_int64(2)
        lo_hi.copy_(torch.stack(torch.aminmax(kept)), non_blocking=True)
        answered = self.backend.event_after(self.backend.current_stream(self.device))
        slots = slots.clamp(0, limit - 1)
        if rows == 1:
            idx = slots.view(1, -1)
        else:
            blocks = torch.div(slots, bs, rounding_mode="floor")
            idx = torch.stack((blocks, slots - blocks * bs))

        def check() -> None:
            self.backend.event_synchronize(answered)
            lo, hi = lo_hi.tolist()
            if lo < 0 or hi >= limit:  # find the culprits on the host (error path only)
                host = transfer.slot_mapping.to("cpu", torch.int64)[token_ids()]
                self.cache.check_slots(host, token_ids)

        return idx, check

    def _fill_indices(self, idx: torch.Tensor, slots: torch.Tensor) -> None:
        """Write ``[1, n]`` slots or ``[2, n]`` (block, offset) of host ``slots`` into ``idx``."""
        if idx.shape[0] == 1:
            idx[0] = slots
        else:
            torch.div(slots, self.block_size, rounding_mode="floor", out=idx[0])
            torch.remainder(slots, self.block_size, out=idx[1])

    def _pinned_int64(self, numel: int) -> torch.Tensor:
        """``[numel]`` int64 of page-locked host memory (the backend's, exact size)."""
        return self.backend.pinned_empty(numel * 8).view(torch.int64)

    def close(self) -> None:
        """Drop the pinned buffers."""
        self.uploads.close()
