# SPDX-License-Identifier: Apache-2.0
"""Loads lmcache's CUDA extension (the ``torch.ops.lmcache`` ops), once per process.

The sources ship inside the package (``lmcache/csrc/``). :func:`load`, called by
:mod:`lmcache.gpu_ops` on the first op on a CUDA tensor, tries in turn:

1. ``LMCACHE_DISABLE_CEXT=1``: never load; the pure-torch ops are used.
2. A build made at install, ``lmcache._C``, if its ``sources_hash`` matches the shipped sources
   (a stale one is skipped with a warning).
3. A JIT build with ``torch.utils.cpp_extension.load`` (nvcc and ninja needed, nothing
   downloaded) into ``$XDG_CACHE_HOME/lmcache/cext-<hash>`` (default ``~/.cache``; folders
   0700), the hash covering the sources, torch, CUDA, Python and the target architectures, so a
   later process reuses it. Targets: ``sm_90`` plus the visible devices' architectures, with
   PTX of the lowest for the others. One log line gives the time.
4. Otherwise one log line says why, and the pure-torch ops are used.

``LMCACHE_REQUIRE_CEXT=1`` turns 4 (and 1) into :class:`CextUnavailableError`, naming what is
missing and how to fix it. Neither variable is a config key.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from lmcache.errors import CextUnavailableError

__all__ = [
    "DISABLE_ENV",
    "REQUIRE_ENV",
    "SOURCES",
    "SOURCES_DIR",
    "CextStatus",
    "CextUnavailableError",
    "cache_dir",
    "disabled",
    "load",
    "required",
    "sources_hash",
    "status",
]

logger = logging.getLogger(__name__)

DISABLE_ENV = "LMCACHE_DISABLE_CEXT"
"""``1``: never load the extension (the pure-torch ops are used everywhere)."""

REQUIRE_ENV = "LMCACHE_REQUIRE_CEXT"
"""``1``: fail (:class:`CextUnavailableError`) instead of falling back to the pure-torch ops."""

SOURCES_DIR = Path(__file__).resolve().parents[1] / "csrc"
"""Where the extension's sources ship (package data)."""

SOURCES = ("torch_bindings.cpp", "kv_ops.cpp", "kv_gather.cu", "kv_scatter.cu", "checksum.cu")
"""Translation units of the extension."""

_HEADERS = ("ops.h", "kv_copy_params.h", "kv_copy.cuh", "checksum.cuh")
_OPS = ("gather_kv", "scatter_kv", "checksum_chunks")
_TRUE = frozenset({"1", "true", "yes", "on"})


@dataclass(frozen=True)
class CextStatus:
    """What :func:`load` did.

    Attributes:
        loaded: The ``torch.ops.lmcache`` CUDA ops are registered in this process.
        mode: ``"prebuilt"``, ``"jit"`` (built now), ``"jit-cached"`` (an earlier build),
            ``"disabled"``, ``"unavailable"`` or ``"not-tried"``.
        detail: Why not loaded, or where it was loaded from.
        seconds: Time the load (and build) took.
    """

    loaded: bool
    mode: str
    detail: str
    seconds: float = 0.0


_LOCK = threading.Lock()
_STATUS: CextStatus | None = None


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


def disabled() -> bool:
    """Whether ``LMCACHE_DISABLE_CEXT`` is set to a true value."""
    return _flag(DISABLE_ENV)


def required() -> bool:
    """Whether ``LMCACHE_REQUIRE_CEXT`` is set to a true value."""
    return _flag(REQUIRE_ENV)


def sources_hash() -> str:
    """SHA-256 (hex, first 16 digits) of the shipped sources and headers."""
    h = hashlib.sha256()
    for name in sorted(SOURCES + _HEADERS):
        h.update(name.encode() + b"\0" + (SOURCES_DIR / name).read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _arch_list() -> str:
    """``TORCH_CUDA_ARCH_LIST`` of a build: 9.0 plus the visible devices', PTX of the lowest."""
    from lmcache.devices.cuda import CudaBackend

    archs = {(9, 0)} | CudaBackend().capabilities()
    ordered = sorted(archs)
    names = [f"{major}.{minor}" for major, minor in ordered]
    names[0] += "+PTX"
    return ";".join(names)


def cache_dir() -> Path:
    """Build folder of the JIT extension for this torch, CUDA, Python and these sources."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lmcache"
    key = "|".join(
        [
            sources_hash(),
            torch.__version__,
            str(torch.version.cuda),
            f"{sys.version_info.major}.{sys.version_info.minor}",
            _arch_list(),
        ]
    )
    return root / f"cext-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def status() -> CextStatus:
    """What :func:`load` did, without loading (``mode="not-tried"`` before the first load)."""
    return _STATUS or CextStatus(False, "not-tried", "load() has not run in this process")


def load() -> CextStatus:
    """Load the extension once (thread-safe); later calls return the first result.

    Returns:
        The :class:`CextStatus`.

    Raises:
        CextUnavailableError: ``LMCACHE_REQUIRE_CEXT=1`` and the extension cannot be loaded
            (or ``LMCACHE_DISABLE_CEXT=1`` is set too).
    """
    global _STATUS
    with _LOCK:
        if _STATUS is None:
            _STATUS = _load()
        result = _STATUS
    if not result.loaded and required():
        raise CextUnavailableError(
            f"{REQUIRE_ENV}=1 but lmcache's CUDA extension is not loaded: {result.detail}. "
            f"Fix that, or unset {REQUIRE_ENV} to use the pure-torch ops."
        )
    return result


def _load() -> CextStatus:
    if disabled():
        why = f"{DISABLE_ENV}=1 is set"
        if required():
            why += f" together with {REQUIRE_ENV}=1 (they contradict each other: unset one)"
        logger.info("lmcache: %s; using the pure-torch ops", why)
        return CextStatus(False, "disabled", why)
    start = time.perf_counter()
    prebuilt = _load_prebuilt()
    if prebuilt is not None:
        status = CextStatus(True, "prebuilt", prebuilt, time.perf_counter() - start)
        _register_fakes()
        logger.info("lmcache: loaded the CUDA extension %s in %.2f s", prebuilt, status.seconds)
        return status
    missing = _jit_missing()
    if missing:
        why = "; ".join(missing)
        logger.info("lmcache: CUDA extension not built (%s); using the pure-torch ops", why)
        return CextStatus(False, "unavailable", why)
    return _load_jit(start)


def _load_prebuilt() -> str | None:
    """Import ``lmcache._C`` (a build at install); its path, or ``None`` to try a JIT build."""
    try:
        module = importlib.import_module("lmcache._C")
    except ModuleNotFoundError:
        return None
    except ImportError as exc:  # built for another torch or CUDA: warn, build anew
        logger.warning("lmcache: could not import lmcache._C (%s); trying a JIT build", exc)
        return None
    built = getattr(module, "sources_hash", "unknown")
    if built != sources_hash():
        logger.warning(
            "lmcache: lmcache._C was built from other sources (%s, shipped %s); "
            "reinstall lmcache-core to rebuild it. Trying a JIT build.",
            built,
            sources_hash(),
        )
        return None
    return str(getattr(module, "__file__", "lmcache._C"))


def _cuda_available() -> bool:
    from lmcache.devices import get_backend

    return get_backend("cuda").is_available()


def _jit_missing() -> list[str]:
    """What a JIT build lacks here (empty: it can be tried)."""
    missing = []
    if torch.version.cuda is None:
        missing.append(f"torch {torch.__version__} is not a CUDA build")
    elif not _cuda_available():
        missing.append("no CUDA device is visible")
    try:
        from torch.utils import cpp_extension
    except ImportError as exc:  # pragma: no cover - part of torch
        return [*missing, f"torch.utils.cpp_extension cannot be imported ({exc})"]
    home = cpp_extension.CUDA_HOME
    if home is None or not (Path(home) / "bin" / "nvcc").exists():
        missing.append(
            "no CUDA toolkit: nvcc not found (install the CUDA toolkit matching torch's CUDA "
            f"{torch.version.cuda} and set CUDA_HOME)"
        )
    if not cpp_extension.is_ninja_available():
        missing.append("ninja not found (pip install ninja)")
    return missing


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _load_jit(start: float) -> CextStatus:
    from torch.utils import cpp_extension

    folder = cache_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        folder.chmod(0o700)
    cached = (folder / "lmcache_C.so").exists()
    define = f"-DLMCACHE_SOURCES_HASH={sources_hash()}"
    try:
        with _env("TORCH_CUDA_ARCH_LIST", _arch_list()):
            cpp_extension.load(
                name="lmcache_C",
                sources=[str(SOURCES_DIR / s) for s in SOURCES],
                extra_cflags=["-O3", define],
                extra_cuda_cflags=["-O3", define],
                extra_include_paths=[str(SOURCES_DIR)],
                build_directory=str(folder),
                is_python_module=False,
                verbose=False,
            )
    except Exception as exc:  # a compiler error, a broken toolkit: fall back, say why
        why = f"the JIT build in {folder} failed: {str(exc).strip()[-2000:]}"
        logger.warning("lmcache: %s; using the pure-torch ops", why)
        return CextStatus(False, "unavailable", why)
    seconds = time.perf_counter() - start
    _register_fakes()
    if cached:
        logger.info("lmcache: loaded the CUDA extension from %s in %.2f s", folder, seconds)
        return CextStatus(True, "jit-cached", str(folder), seconds)
    logger.info("lmcache: built the CUDA extension in %.1f s (%s)", seconds, folder)
    return CextStatus(True, "jit", str(folder), seconds)


def _no_outputs(*args: object, **kwargs: object) -> None:
    """Fake (meta) implementation of the ops: they only write their mutable arguments."""
    return None


def _register_fakes() -> None:
    """Shape functions for the ops (``torch.library.opcheck``, ``torch.compile``)."""
    for op in _OPS:
        with contextlib.suppress(RuntimeError):  # already registered (a second load path)
            torch.library.register_fake(f"lmcache::{op}")(_no_outputs)
