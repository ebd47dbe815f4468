# SPDX-License-Identifier: Apache-2.0
"""The one INFO line an engine adapter logs when lmcache starts in a process.

It says which packages, at which versions, serve which engine on which device, and which
implementation of lmcache's KV copy ops runs there::

    lmcache 0.1.0 (lmcache-core 0.1.0, lmcache-vllm 0.1.0) serves vLLM 0.32.0 on cuda:0: kernels: triton

The adapters call :func:`log_banner` from their connector constructors (vLLM: both the scheduler
and the worker side; SGLang: each hook). It logs once per process and engine (and hook), however
many connectors the process builds, and never raises: a line that cannot be composed is skipped.
``LMCACHE_LOG_LEVEL=WARNING`` (or higher) drops it with lmcache's other INFO lines.

Versions come from the installed distributions' metadata (``lmcache-core``, ``lmcache-vllm``,
``lmcache-sglang``), so a stale editable install or a mix of wheels shows up here. The kernels
part is :func:`kernels_for`.
"""

from __future__ import annotations

import importlib.metadata
import logging
import threading

import torch

__all__ = ["banner_line", "dist_version", "kernels_for", "log_banner"]

logger = logging.getLogger(__name__)

CORE_DIST = "lmcache-core"
CPU_NOTE = "CPU path, no CUDA kernels"

_logged: set[str] = set()  # engines (and hooks) whose line this process already logged
_logged_lock = threading.Lock()


def dist_version(dist: str) -> str:
    """The installed version of distribution ``dist``, or ``"not installed"``."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def kernels_for(device: str | torch.device) -> str:
    """Which implementation of lmcache's KV copy ops serves ``device``.

    ``lmcache.gpu_ops.implementation(device)`` (``"cuda-kernels"``, ``"triton"``,
    ``"torch-vectorized"``, ``"torch-reference"``); compiled kernels add where they came from and
    the GPU code they hold (``"cuda-kernels (wheel: sm_75, ..., compute_120)"``). A CPU device adds
    ``"(CPU path, no CUDA kernels)"``.
    """
    dev = torch.device(device)
    from lmcache import gpu_ops
    from lmcache.gpu_ops import _cext

    try:
        name = str(gpu_ops.implementation(dev))
    except Exception as exc:  # the banner must never stop an engine
        return f"unknown ({type(exc).__name__}: {exc})"
    status = _cext.status()
    if name == "cuda-kernels" and status.loaded:
        name += f" ({status.mode}: {', '.join(status.archs) or 'architectures unknown'})"
    return f"{name} ({CPU_NOTE})" if dev.type == "cpu" else name


def banner_line(
    engine: str,
    engine_version: str,
    adapter_dist: str,
    device: str | torch.device,
    *,
    hook: str | None = None,
) -> str:
    """The banner's text, e.g. ``lmcache 0.1.0 (lmcache-core 0.1.0, lmcache-vllm 0.1.0) serves
    vLLM 0.32.0 on cpu: kernels: torch-reference (CPU path, no CUDA kernels)``.

    Args:
        engine: The engine's name as users write it (``"vLLM"``, ``"SGLang"``).
        engine_version: The engine's ``__version__``.
        adapter_dist: The adapter's distribution (``"lmcache-vllm"``, ``"lmcache-sglang"``).
        device: The device the engine's KV cache lives on (``"cuda:0"``, ``"cpu"``, ...).
        hook: Which of the engine's hooks loaded lmcache, when it has several (SGLang).
    """
    import lmcache

    via = f" ({hook})" if hook else ""
    return (
        f"lmcache {lmcache.__version__} ({CORE_DIST} {dist_version(CORE_DIST)}, "
        f"{adapter_dist} {dist_version(adapter_dist)}) serves {engine} {engine_version}{via} "
        f"on {torch.device(device)}: kernels: {kernels_for(device)}"
    )


def _quiet() -> bool:
    """``LMCACHE_LOG_LEVEL`` (or code) set lmcache's logger above INFO."""
    level = logging.getLogger("lmcache").level
    return level > logging.INFO


def log_banner(
    engine: str,
    engine_version: str,
    adapter_dist: str,
    device: str | torch.device,
    *,
    hook: str | None = None,
    log: logging.Logger | None = None,
) -> bool:
    """Log :func:`banner_line` at INFO once per process for ``engine`` (and ``hook``).

    Args:
        log: The logger to write to (default ``lmcache.banner``). vLLM's adapter passes one
            under vLLM's ``vllm`` logger, whose handler prints vLLM's INFO lines; a library's
            own logger prints nothing unless the application configured logging.

    Returns:
        Whether the line was logged now (False: already logged in this process, lmcache's
        loggers are set above INFO, or the line could not be composed).
    """
    key = engine if hook is None else f"{engine}/{hook}"
    with _logged_lock:
        if key in _logged:
            return False
        _logged.add(key)
    if _quiet():
        return False
    try:
        line = banner_line(engine, engine_version, adapter_dist, device, hook=hook)
    except Exception:  # never stop an engine for a log line
        logger.debug("lmcache: could not compose the start-up line", exc_info=True)
        return False
    (log or logger).info("%s", line)
    return True
