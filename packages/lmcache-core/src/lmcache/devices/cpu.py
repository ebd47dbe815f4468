# SPDX-License-Identifier: Apache-2.0
"""The CPU backend: no streams (``None``), synchronous copies, events that are always complete,
plain host memory."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from lmcache.devices.backend import DeviceBackend, copy_pair

__all__ = ["CpuBackend", "DoneEvent"]


class DoneEvent:
    """An event of a device without streams: complete from the start."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class CpuBackend(DeviceBackend):
    """The host itself as a device (vLLM's and SGLang's CPU engines)."""

    device_type = "cpu"
    has_streams = False

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def device_for_rank(self, local_rank: int) -> torch.device:
        return torch.device("cpu")

    def current_stream(self, device: torch.device) -> Any:
        return None

    def new_stream(self, device: torch.device, priority: int = 0) -> Any:
        return None

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def wait_stream(self, waiter: Any, stream: Any) -> None:
        return None

    def synchronize(self, target: Any = None) -> None:
        return None

    def new_event(self, blocking: bool = False) -> Any:
        return DoneEvent()

    def record_event(self, event: Any, stream: Any) -> Any:
        return event

    def wait_event(self, stream: Any, event: Any) -> None:
        return None

    def event_synchronize(self, event: Any) -> None:
        return None

    def event_query(self, event: Any) -> bool:
        return True

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(int(nbytes), dtype=torch.uint8)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any = None) -> None:
        d, s = copy_pair(dst, src, "CpuBackend.copy")
        d.copy_(s)
