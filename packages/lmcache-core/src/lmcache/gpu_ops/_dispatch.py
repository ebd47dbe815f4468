# SPDX-License-Identifier: Apache-2.0
"""Which implementation of the ``torch.ops.lmcache`` ops serves a device, and the one WARNING
when a CUDA device does not get the compiled kernels.

In order, for tensors on a CUDA device:

1. ``"cuda-kernels"``: the compiled ops, when :func:`lmcache.gpu_ops._cext.load` loaded them.
2. ``"triton"``: their Triton port (:mod:`lmcache.gpu_ops._triton`), when ``triton`` imports and
   its first compile and run here give the pinned checksum of a probe.
3. ``"torch-vectorized"``: :mod:`lmcache.gpu_ops._vectorized` (a fixed number of torch launches,
   no host wait).

CPU and XPU tensors take ``"torch-vectorized"`` (bit for bit the reference, which the tests
check). Any other device type takes ``"torch-reference"`` (:mod:`lmcache.gpu_ops._ref`, the
oracle: a loop per chunk that reads the offsets on the host). The first op on a CUDA device
without the kernels logs one WARNING per process: the cause, which fallback runs, and the fix.
"""

from __future__ import annotations

import logging
import threading

import torch

from lmcache.gpu_ops import _cext

__all__ = ["IMPLEMENTATIONS", "implementation", "resolve", "triton_failed"]

logger = logging.getLogger("lmcache.gpu_ops")

IMPLEMENTATIONS = ("cuda-kernels", "triton", "torch-vectorized", "torch-reference")
"""What :func:`implementation` may return, fastest first."""

_PROBE_SUM = 0x05EB0B8E2D0277F8  # checksum of bytes 0..15 (a pinned vector of the checksum)

_LOCK = threading.Lock()
_triton_why: str | None = None  # None: not probed; "": usable; else why not
_warned = False


def _probe_triton(device: torch.device) -> str:
    """Why Triton cannot serve ``device`` (empty: it can): import, compile, run, compare."""
    try:
        from lmcache.gpu_ops import _triton
    except ImportError as exc:
        return f"Triton is not installed ({exc})"
    try:
        data = torch.arange(16, dtype=torch.uint8, device=device)
        out = torch.empty(1, dtype=torch.int64, device=device)
        offsets = torch.tensor([0, 16], dtype=torch.int64, device=device)
        _triton.checksum_chunks(data, offsets, 1, out)
        got = int(out.item()) % (1 << 64)  # once per process, at first use
    except Exception as exc:  # no C compiler, an unsupported GPU, a Triton bug: fall back
        return f"Triton could not compile or run its kernels ({type(exc).__name__}: {exc})"
    if got != _PROBE_SUM:
        return f"Triton's kernels gave a wrong checksum ({got:#x}, expected {_PROBE_SUM:#x})"
    return ""


def _triton_reason(device: torch.device) -> str:
    global _triton_why
    with _LOCK:
        if _triton_why is None:
            _triton_why = _probe_triton(device)
        return _triton_why


def implementation(device: torch.device | str) -> str:
    """The implementation of gather, scatter and checksums for tensors on ``device``.

    Loads the CUDA extension (and probes Triton) on the first CUDA query. Logs nothing.

    Returns:
        One of :data:`IMPLEMENTATIONS`.

    Raises:
        CextUnavailableError: ``LMCACHE_REQUIRE_CEXT=1`` and the extension cannot load.
    """
    dev = torch.device(device)
    if dev.type == "cuda" or _cext.required():
        loaded = _cext.load().loaded  # raises when required and absent
        if dev.type == "cuda":
            if loaded:
                return "cuda-kernels"
            return "triton" if not _triton_reason(dev) else "torch-vectorized"
    if dev.type in ("cpu", "xpu"):
        return "torch-vectorized"
    return "torch-reference"


def resolve(device: torch.device | str) -> str:
    """:func:`implementation`, logging the one WARNING of a CUDA device without the kernels."""
    name = implementation(device)
    if torch.device(device).type == "cuda" and name != "cuda-kernels":
        _warn_once(torch.device(device), name)
    return name


def _warn_once(device: torch.device, name: str) -> None:
    global _warned
    with _LOCK:
        if _warned:
            return
        _warned = True
    status = _cext.status()
    if status.mode == "disabled":
        cause = f"lmcache's CUDA kernels are disabled on purpose ({_cext.DISABLE_ENV}=1 is set)"
        fix = f"unset {_cext.DISABLE_ENV} to use them; where they are not built, {_cext.FIX}"
    else:
        cause = f"lmcache's CUDA kernels are not loaded ({status.detail})"
        fix = _cext.FIX
    if name == "triton":
        fallback = "their Triton port (the same bytes and checksums, compiled here by Triton)"
    else:
        fallback = (
            f"vectorized torch ops, slower than the kernels ({_triton_why or 'Triton unused'})"
        )
    logger.warning(
        "lmcache: %s. KV gather, scatter and checksums on %s run as %s. Fix: %s.",
        cause,
        device,
        fallback,
        fix,
    )


def triton_failed(device: torch.device, exc: BaseException) -> None:
    """A Triton op failed to compile or launch: log it and use the vectorized ops from now on."""
    global _triton_why
    with _LOCK:
        _triton_why = f"a Triton kernel failed ({type(exc).__name__}: {exc})"
    logger.warning(
        "lmcache: %s on %s; KV gather, scatter and checksums run as vectorized torch ops from "
        "now on. Fix: %s.",
        _triton_why,
        device,
        _cext.FIX,
    )
