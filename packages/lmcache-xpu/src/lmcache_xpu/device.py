# SPDX-License-Identifier: Apache-2.0
"""The Intel GPU (XPU) device backend: :class:`XpuBackend` over ``torch.xpu``.

It gives lmcache's connectors (the same vLLM and SGLang classes that serve CUDA) everything they
do to an XPU besides torch ops on its tensors:

- the device of a local rank: ``xpu:<local_rank % device_count>`` (vLLM's XPU worker uses
  ``xpu:<local_rank>``, SGLang ``xpu:<gpu_id>``; with ``ZE_AFFINITY_MASK`` giving each process
  one device, every rank is ``xpu:0``);
- streams (``torch.xpu.Stream``, ``torch.xpu.current_stream``, ``torch.xpu.stream``) and events
  (``torch.xpu.Event``: record, wait, query, synchronize);
- page-locked host memory where torch offers it for XPU (``torch.empty(..., pin_memory=True)``,
  probed once); where it does not, one log line says so and host buffers are plain memory;
- copies: ``dst.copy_(src, non_blocking=True)`` under ``torch.xpu.stream(s)`` (there is no raw
  runtime call like ``cudaMemcpyAsync`` here: batches and 2D copies are one torch copy per pair
  or per row, :class:`~lmcache.devices.backend.DeviceBackend`'s defaults), and synchronize.

The gather/scatter around the copies is the connectors' pure-torch path (indexing ops that run on
any device); no CUDA-only op is reached: the CUDA kernels are registered for CUDA only.

:func:`register` is the ``lmcache.devices`` entry point (``xpu = "lmcache_xpu.device:register"``).
The runtime module is injectable (``XpuBackend(xpu=...)``) so tests run the whole path on the CPU
with :mod:`lmcache_xpu.testing`'s stand-in for ``torch.xpu``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

import torch

from lmcache.devices import DeviceBackend, register_backend
from lmcache.devices.backend import copy_pair

__all__ = ["XpuBackend", "register"]

logger = logging.getLogger(__name__)


class XpuBackend(DeviceBackend):
    """Intel GPUs through ``torch.xpu`` (see the module docstring).

    Args:
        xpu: The runtime module, ``torch.xpu`` by default (read when first used). Tests pass
            :class:`lmcache_xpu.testing.FakeXpu`.
        device_type: The ``torch.device.type`` of the tensors served: ``"xpu"``. A stand-in
            run serves ``"cpu"`` tensors as if they were on an XPU: every device handed in is
            then passed to the runtime module as ``xpu:<index>``.
        pin_memory: Whether host buffers are page-locked with ``torch.empty(...,
            pin_memory=True)``; ``None``: probe torch once (the probe's failure is logged).
    """

    has_streams = True

    def __init__(
        self, xpu: Any = None, *, device_type: str = "xpu", pin_memory: bool | None = None
    ) -> None:
        self._xpu_module = xpu
        self.device_type = device_type
        self._pin: bool | None = pin_memory
        self._pin_lock = threading.Lock()

    @property
    def xpu(self) -> Any:
        """The runtime module (``torch.xpu`` unless one was injected)."""
        return torch.xpu if self._xpu_module is None else self._xpu_module

    def _device(self, device: Any) -> torch.device:
        """``device`` as the runtime sees it: ``xpu:<index>`` (index 0 when none is given)."""
        d = torch.device(device) if not isinstance(device, torch.device) else device
        if d.type not in ("xpu", self.device_type):
            raise ValueError(
                f"XpuBackend got device {str(d)!r}; expected an xpu device (or "
                f"{self.device_type!r}, the tensors it serves)"
            )
        return torch.device("xpu", 0 if d.index is None else d.index)

    # -- devices -----------------------------------------------------------------------------

    def is_available(self) -> bool:
        try:
            return bool(self.xpu.is_available())
        except (AttributeError, RuntimeError):  # a torch built without XPU support
            return False

    def device_count(self) -> int:
        return int(self.xpu.device_count()) if self.is_available() else 0

    def set_device(self, device: torch.device) -> None:
        self.xpu.set_device(self._device(device))

    def empty_cache(self) -> None:
        if self.is_available():
            self.xpu.empty_cache()

    # -- streams and events ------------------------------------------------------------------

    def current_stream(self, device: torch.device) -> Any:
        return self.xpu.current_stream(self._device(device))

    def new_stream(self, device: torch.device, priority: int = 0) -> Any:
        return self.xpu.Stream(device=self._device(device), priority=priority)

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        if stream is None:
            return contextlib.nullcontext()
        return self.xpu.stream(stream)  # type: ignore[no-any-return]

    def wait_stream(self, waiter: Any, stream: Any) -> None:
        waiter.wait_stream(stream)

    def synchronize(self, target: Any = None) -> None:
        if target is None:
            self.xpu.synchronize()
        elif isinstance(target, (torch.device, str)):
            self.xpu.synchronize(self._device(target))
        else:
            target.synchronize()

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        if tensor.device.type == "xpu" and stream is not None:
            tensor.record_stream(stream)

    def new_event(self, blocking: bool = False) -> Any:
        # torch.xpu.Event has no blocking flag: a host wait on it is the runtime's own
        return self.xpu.Event()

    def record_event(self, event: Any, stream: Any) -> Any:
        if stream is None:
            event.record()
        else:
            event.record(stream)
        return event

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def event_synchronize(self, event: Any) -> None:
        event.synchronize()

    def event_query(self, event: Any) -> bool:
        return bool(event.query())

    # -- host memory -------------------------------------------------------------------------

    def _pins(self) -> bool:
        """Whether torch page-locks host memory here (probed once; a failure is logged once)."""
        if self._pin is None:
            with self._pin_lock:
                if self._pin is None:
                    try:
                        probe = torch.empty(1, dtype=torch.uint8, pin_memory=True)
                        self._pin = bool(probe.is_pinned())
                        reason = "" if self._pin else "the tensor came back pageable"
                    except RuntimeError as exc:
                        self._pin, reason = False, str(exc)
                    if not self._pin:
                        logger.warning(
                            "lmcache_xpu: torch %s offers no pinned host memory for XPU here "
                            "(%s); host buffers are pageable memory, so host<->XPU copies are "
                            "staged by the runtime and slower",
                            torch.__version__,
                            reason,
                        )
        return self._pin

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        """``[nbytes]`` uint8 host memory, page-locked by torch where it can for XPU (its pinned
        allocator may round the allocation up), else plain memory (logged once)."""
        nbytes = int(nbytes)
        pin = nbytes > 0 and self._pins()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        if tensor.device.type != "cpu" or not self._pins():
            return False
        return bool(tensor.is_pinned())

    # -- copies ------------------------------------------------------------------------------

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any = None) -> None:
        """``dst.copy_(src, non_blocking=True)`` on ``stream`` (``None``: the current stream of
        the XPU side)."""
        d, s = copy_pair(dst, src, "XpuBackend.copy")
        if stream is None:
            served = [t.device for t in (d, s) if t.device.type == self.device_type]
            if not served:  # host to host: nothing of the device's to order against
                d.copy_(s)
                return
            stream = self.current_stream(served[0])
        with self.xpu.stream(stream):
            d.copy_(s, non_blocking=True)


def register() -> None:
    """Serve ``xpu`` devices with :class:`XpuBackend` over ``torch.xpu`` (the ``lmcache.devices``
    entry point). A backend already registered for ``xpu`` (a test's stand-in, an earlier
    call) is kept."""
    try:
        register_backend(XpuBackend())
    except ValueError as exc:
        logger.debug("lmcache_xpu.device.register: keeping the registered backend: %s", exc)
