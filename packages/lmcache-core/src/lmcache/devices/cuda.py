# SPDX-License-Identifier: Apache-2.0
"""The CUDA backend, and the CUDA runtime library (``libcudart``, through ctypes) it calls
where torch has no equivalent: ``cudaMemcpyAsync`` (a few microseconds of host time, where a
torch ``copy_`` costs several times that), ``cudaMemcpy2DAsync``, ``cudaMemcpyBatchAsync``
(runtime 12.8+; probed once) and ``cudaHostRegister`` (page-locks a caller's allocation in
place, :meth:`CudaBackend.host_register`).

This is the only module of lmcache that calls ``torch.cuda``; everything else goes through
:class:`CudaBackend` (``lmcache.devices.get_backend("cuda")``).

A raw copy is invisible to torch's pinned allocator: it may hand a dropped buffer out again while
the DMA still runs. So a raw copy's host buffer is always one that knows about the DMA:

- a chunk of lmcache's pinned pool, whose lease is released only after its copy was waited for;
- a buffer of :class:`~lmcache.devices.UploadRing`, reused only once its upload's event completed;
- a buffer kept alive until a synchronise (the connectors' warm-up).

Small transient buffers (checksum downloads, slot bounds) move with torch's own ``copy_``
instead, which records the stream with the allocator.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmcache.devices.backend import DeviceBackend, copy_pair

__all__ = ["CudaBackend", "CudaRuntime", "cudart"]

logger = logging.getLogger(__name__)

_H2D, _D2H, _D2D = 1, 2, 3  # cudaMemcpyKind
_SRC_ACCESS_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    """``cudaMemcpyAttributes`` (CUDA 12.8+)."""

    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


@dataclass
class CudaRuntime:
    """The loaded ``libcudart`` with argument types set.

    Attributes:
        lib: The ctypes library.
        version: ``cudaRuntimeGetVersion`` (e.g. ``13000``), 0 when unknown.
        batch: ``cudaMemcpyBatchAsync``, or ``None`` (runtime older than 12.8, or switched off
            with ``LMCACHE_DISABLE_MEMCPY_BATCH=1``).
        batch_fail_idx: Whether ``batch`` takes the ``failIdx`` argument (12.8 and 12.9; 13.0
            removed it).
    """

    lib: Any
    version: int
    batch: Any = None
    batch_fail_idx: bool = False

    def check(self, err: int, what: str) -> None:
        """Raise ``RuntimeError`` with the runtime's own message when ``err`` is not success."""
        if err != 0:
            self.lib.cudaGetLastError()  # clear it: torch would report it on its next launch
            message = self.lib.cudaGetErrorString(err).decode(errors="replace")
            raise RuntimeError(f"lmcache: {what} failed: {message} (cudaError {err})")


_RUNTIME: CudaRuntime | None = None
_RUNTIME_LOADED = False
_RUNTIME_LOCK = threading.Lock()


def _candidates() -> list[str]:
    """``libcudart`` paths: the one this process has mapped (torch's) first."""
    found = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1] if "/" in line else ""
                if os.path.basename(path).startswith("libcudart.so") and path not in found:
                    found.append(path)
    except OSError:
        pass
    return [*found, "libcudart.so.13", "libcudart.so.12", "libcudart.so"]


def _load(name: str) -> CudaRuntime | None:
    try:
        lib = ctypes.CDLL(name)
        lib.cudaMemcpy2DAsync  # noqa: B018 - probe
    except (OSError, AttributeError):
        return None
    ptr, size, cint = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    lib.cudaMemcpy2DAsync.argtypes = [ptr, size, ptr, size, size, size, cint, ptr]
    lib.cudaMemcpy2DAsync.restype = cint
    lib.cudaMemcpyAsync.argtypes = [ptr, ptr, size, cint, ptr]  # dst, src, n, kind, stream
    lib.cudaMemcpyAsync.restype = cint
    lib.cudaHostRegister.argtypes = [ptr, size, ctypes.c_uint]
    lib.cudaHostRegister.restype = cint
    lib.cudaHostUnregister.argtypes = [ptr]
    lib.cudaHostUnregister.restype = cint
    lib.cudaGetErrorString.argtypes = [cint]
    lib.cudaGetErrorString.restype = ctypes.c_char_p
    lib.cudaGetLastError.argtypes = []
    lib.cudaGetLastError.restype = cint
    version = ctypes.c_int(0)
    try:
        lib.cudaRuntimeGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.cudaRuntimeGetVersion.restype = cint
        if lib.cudaRuntimeGetVersion(ctypes.byref(version)) != 0:
            version.value = 0
    except AttributeError:
        pass
    rt = CudaRuntime(lib, int(version.value))
    off = os.environ.get("LMCACHE_DISABLE_MEMCPY_BATCH", "0").strip().lower()
    if rt.version >= 12080 and off in {"", "0", "false", "no", "off"}:
        try:
            fn = lib.cudaMemcpyBatchAsync
        except AttributeError:
            fn = None
        if fn is not None:
            pp, sp = ctypes.POINTER(ptr), ctypes.POINTER(size)
            rt.batch_fail_idx = rt.version < 13000  # 13.0 dropped ``size_t* failIdx``
            args: list[Any] = [pp, pp, sp, size, ctypes.POINTER(_MemcpyAttributes), sp, size]
            fn.argtypes = [*args, sp, ptr] if rt.batch_fail_idx else [*args, ptr]
            fn.restype = cint
            rt.batch = fn
    return rt


def cudart() -> CudaRuntime | None:
    """The CUDA runtime torch loaded, loaded once; ``None`` when it cannot be found (copies
    then go through torch: strided copies row by row, batches one by one)."""
    global _RUNTIME, _RUNTIME_LOADED
    if _RUNTIME_LOADED:
        return _RUNTIME
    with _RUNTIME_LOCK:
        if not _RUNTIME_LOADED:
            for name in _candidates():
                _RUNTIME = _load(name)
                if _RUNTIME is not None:
                    break
            else:
                logger.info("lmcache: libcudart not found; host copies go through torch")
            _RUNTIME_LOADED = True
    return _RUNTIME


def _kind(dst: torch.Tensor, src: torch.Tensor) -> int:
    if dst.is_cuda:
        return _D2D if src.is_cuda else _H2D
    return _D2H


def _handle(stream: Any, dst: torch.Tensor, src: torch.Tensor) -> int:
    """The ``cudaStream_t`` of ``stream`` (``None``: the current stream of the CUDA side)."""
    if stream is None:
        stream = torch.cuda.current_stream(dst.device if dst.is_cuda else src.device)
    return int(stream.cuda_stream)


_PINNED: dict[tuple[int, int], bool] = {}
"""Page-lock answers per host storage (address, size): each answer is a driver query."""

_PINNED_MAX = 4096


def _host_pinned(host: torch.Tensor) -> bool:
    """Whether ``host``'s storage is page-locked, asked of the driver once per storage.

    A stale answer after the storage was freed and its address reused costs speed, not bytes:
    the runtime copies pageable memory correctly, only synchronously.
    """
    storage = host.untyped_storage()
    key = (storage.data_ptr(), storage.nbytes())
    answer = _PINNED.get(key)
    if answer is None:
        if len(_PINNED) >= _PINNED_MAX:  # bounded: transient buffers come and go
            _PINNED.clear()
        answer = _PINNED[key] = host.is_pinned()
    return answer


def _raw_ok(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether a raw runtime copy may move this pair: contiguous, one side on the device, and the
    host side page-locked. Pageable host memory takes torch's copy, which stages it safely."""
    if not (dst.is_contiguous() and src.is_contiguous()):
        return False
    if dst.is_cuda and src.is_cuda:
        return True
    host = src if dst.is_cuda else dst
    if host.is_cuda or not (dst.is_cuda or src.is_cuda):
        return False
    return _host_pinned(host)


class CudaBackend(DeviceBackend):
    """NVIDIA GPUs through ``torch.cuda`` and ``libcudart``."""

    device_type = "cuda"
    has_streams = True

    def __init__(self) -> None:
        self._batch_failed_logged = False

    # -- devices -----------------------------------------------------------------------------

    def is_available(self) -> bool:
        return bool(torch.cuda.is_available())

    def device_count(self) -> int:
        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0

    def set_device(self, device: torch.device) -> None:
        torch.cuda.set_device(device)

    def empty_cache(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def capabilities(self) -> set[tuple[int, int]]:
        """Compute capabilities of the visible devices."""
        return {torch.cuda.get_device_capability(i) for i in range(self.device_count())}

    def driver_version(self) -> int:
        """The CUDA version the NVIDIA driver supports (``cudaDriverGetVersion``, e.g. 13000);
        0 when no driver or runtime is found."""
        rt = cudart()
        if rt is None:
            return 0
        version = ctypes.c_int(0)
        try:
            fn = rt.lib.cudaDriverGetVersion
        except AttributeError:
            return 0
        fn.argtypes = [ctypes.POINTER(ctypes.c_int)]
        fn.restype = ctypes.c_int
        return int(version.value) if fn(ctypes.byref(version)) == 0 else 0

    # -- streams and events ------------------------------------------------------------------

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def new_stream(self, device: torch.device, priority: int = 0) -> Any:
        return torch.cuda.Stream(device, priority=priority)  # type: ignore[no-untyped-call]

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        if stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(stream)

    def wait_stream(self, waiter: Any, stream: Any) -> None:
        waiter.wait_stream(stream)

    def synchronize(self, target: Any = None) -> None:
        if target is None:
            torch.cuda.synchronize()
        elif isinstance(target, torch.device):
            torch.cuda.synchronize(target)
        else:
            target.synchronize()

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        if tensor.is_cuda and stream is not None:
            tensor.record_stream(stream)

    def new_event(self, blocking: bool = False) -> Any:
        return torch.cuda.Event(blocking=blocking)  # type: ignore[no-untyped-call]

    def record_event(self, event: Any, stream: Any) -> Any:
        event.record(stream)
        return event

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def event_synchronize(self, event: Any) -> None:
        event.synchronize()

    def event_query(self, event: Any) -> bool:
        return bool(event.query())

    # -- host memory -------------------------------------------------------------------------

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        """``[nbytes]`` uint8 of page-locked host memory, from torch's pinned allocator.

        That allocator reserves a power of two per allocation. An exact-size variant
        (``cudaHostRegister`` of an ``mmap``) was tried: on the H200 one of its registrations
        once outlived its pages, and a later registration at the same address failed with
        cudaError 712. Until that is explained, torch's allocator is used; :meth:`host_register`
        page-locks a caller's own allocation in place.
        """
        nbytes = int(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=nbytes > 0)

    def host_register(self, tensor: torch.Tensor) -> bool:
        rt = cudart()
        if rt is None or tensor.is_cuda or not tensor.is_contiguous():
            return False
        nbytes = tensor.numel() * tensor.element_size()
        err = rt.lib.cudaHostRegister(tensor.data_ptr(), nbytes, 0)
        rt.check(err, f"cudaHostRegister of {nbytes} bytes")
        return True

    def host_unregister(self, tensor: torch.Tensor) -> None:
        rt = cudart()
        if rt is not None:
            rt.check(rt.lib.cudaHostUnregister(tensor.data_ptr()), "cudaHostUnregister")

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return bool(not tensor.is_cuda and tensor.is_pinned())

    # -- copies ------------------------------------------------------------------------------

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any = None) -> None:
        """One ``cudaMemcpyAsync`` for contiguous tensors with page-locked host memory, else torch's
        non-blocking copy on ``stream``."""
        d, s = copy_pair(dst, src, "CudaBackend.copy")
        rt = cudart()
        if rt is not None and _raw_ok(d, s):
            n = d.numel() * d.element_size()
            if n:
                err = rt.lib.cudaMemcpyAsync(
                    d.data_ptr(), s.data_ptr(), n, _kind(d, s), _handle(stream, d, s)
                )
                rt.check(err, f"cudaMemcpyAsync of {n} bytes")
            return
        with self.use_stream(stream):
            d.copy_(s, non_blocking=True)

    def copy_batch(
        self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], stream: Any = None
    ) -> None:
        """One ``cudaMemcpyBatchAsync`` (runtime 12.8+, a stream other than the legacy default
        one, contiguous tensors), else a ``cudaMemcpyAsync`` each. A refused batch is logged
        once and copied one by one."""
        if len(dsts) != len(srcs):
            raise ValueError(f"copy_batch: {len(dsts)} destinations but {len(srcs)} sources")
        rt = cudart()
        if (
            rt is None
            or rt.batch is None
            or len(dsts) < 2
            or not self._batch(rt, dsts, srcs, stream)
        ):
            for d, s in zip(dsts, srcs, strict=True):
                self.copy(d, s, stream)

    def _batch(
        self,
        rt: CudaRuntime,
        dsts: Sequence[torch.Tensor],
        srcs: Sequence[torch.Tensor],
        stream: Any,
    ) -> bool:
        n = len(dsts)
        dp, sp, sizes = (ctypes.c_void_p * n)(), (ctypes.c_void_p * n)(), (ctypes.c_size_t * n)()
        for i, (d, s) in enumerate(zip(dsts, srcs, strict=True)):
            d, s = copy_pair(d, s, "CudaBackend.copy_batch")
            if not _raw_ok(d, s):
                return False
            dp[i], sp[i], sizes[i] = d.data_ptr(), s.data_ptr(), d.numel() * d.element_size()
        handle = _handle(stream, dsts[0], srcs[0])
        if handle == 0:
            return False  # the batch API refuses the legacy default stream
        attrs = _MemcpyAttributes()
        attrs.srcAccessOrder = _SRC_ACCESS_ORDER_STREAM
        attr_idx = ctypes.c_size_t(0)
        args: list[Any] = [dp, sp, sizes, n, ctypes.byref(attrs), ctypes.byref(attr_idx), 1]
        fail_idx = ctypes.c_size_t(0)
        if rt.batch_fail_idx:
            args.append(ctypes.byref(fail_idx))
        err = rt.batch(*args, handle)
        if err == 0:
            return True
        rt.lib.cudaGetLastError()
        if not self._batch_failed_logged:
            self._batch_failed_logged = True
            message = rt.lib.cudaGetErrorString(err).decode(errors="replace")
            logger.warning(
                "lmcache: cudaMemcpyBatchAsync (runtime %d) refused a batch of %d copies (%s); "
                "copying one by one (LMCACHE_DISABLE_MEMCPY_BATCH=1 skips the attempt)",
                rt.version,
                n,
                message,
            )
        return False

    def copy_2d(
        self,
        dst: torch.Tensor,
        dpitch: int,
        src: torch.Tensor,
        spitch: int,
        width: int,
        height: int,
        stream: Any = None,
    ) -> None:
        """One ``cudaMemcpy2DAsync``; row by row when the runtime is not available or the host
        side is pageable."""
        rt = cudart()
        host = src if dst.is_cuda else dst
        if (
            rt is None
            or not (dst.is_cuda or src.is_cuda)
            or (not host.is_cuda and not _host_pinned(host))
        ):
            super().copy_2d(dst, dpitch, src, spitch, width, height, stream)
            return
        err = rt.lib.cudaMemcpy2DAsync(
            dst.data_ptr(),
            dpitch,
            src.data_ptr(),
            spitch,
            width,
            height,
            _kind(dst, src),
            _handle(stream, dst, src),
        )
        rt.check(err, f"cudaMemcpy2DAsync of {height} rows of {width} bytes")
