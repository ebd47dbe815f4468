# SPDX-License-Identifier: Apache-2.0
"""Loads lmcache's CUDA kernels (the ``torch.ops.lmcache`` ops), at most once per process.

The kernels are one shared library on torch's stable ABI (``csrc/``, built by
:mod:`lmcache.gpu_ops.kernel_build`). :func:`load`, called by :mod:`lmcache.gpu_ops` on the first
op on a CUDA tensor, decides which library to load *before* loading any: two copies would both
register the ``lmcache`` namespace, and torch aborts the process on the second. In order:

1. ``LMCACHE_DISABLE_CEXT=1``: nothing is loaded.
2. The ops are already registered in this process (another copy of lmcache loaded them): they
   are used as they are.
3. ``LMCACHE_JIT=1``, or lmcache imported from a source checkout (``LMCACHE_JIT=0`` turns that
   off): the sources are compiled for the visible GPUs into
   ``$XDG_CACHE_HOME/lmcache/kernels-<hash>`` (default ``~/.cache``; folders 0700) and loaded.
   It needs nvcc and a host C++ compiler; a later process reuses the build.
4. The wheel's library, ``lmcache/lib/liblmcache_kernels.so``, when its ``build_info.json``
   says it holds code for every visible GPU and the driver runs its CUDA version.
5. Otherwise nothing: :mod:`lmcache.gpu_ops` falls back to its no-binary implementation.

One INFO line says which library loaded, or why none did. ``LMCACHE_REQUIRE_CEXT=1`` turns
5 (and 1) into :class:`CextUnavailableError`. None of these variables is a config key.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lmcache.errors import CextUnavailableError
from lmcache.gpu_ops import kernel_build

__all__ = [
    "CHECKOUT_SOURCES",
    "DISABLE_ENV",
    "FIX",
    "JIT_ENV",
    "REQUIRE_ENV",
    "WHEEL_LIBRARY",
    "CextStatus",
    "CextUnavailableError",
    "cache_dir",
    "covers",
    "disabled",
    "load",
    "required",
    "sources_dir",
    "status",
    "wheel_build_info",
]

logger = logging.getLogger(__name__)

DISABLE_ENV = "LMCACHE_DISABLE_CEXT"
"""``1``: never load the kernels (the no-binary implementation is used everywhere)."""

REQUIRE_ENV = "LMCACHE_REQUIRE_CEXT"
"""``1``: fail (:class:`CextUnavailableError`) instead of falling back."""

JIT_ENV = "LMCACHE_JIT"
"""``1``: build the kernels from their sources on this machine; ``0``: never (not even from a
checkout)."""

FIX = (
    "install lmcache-core's binary wheel (`nox -s build` makes it; it holds code for sm_75 to "
    "sm_120 and needs an NVIDIA driver for CUDA 13), or set LMCACHE_JIT=1 with nvcc and a C++ "
    "compiler on PATH to build the kernels for this machine"
)
"""How to get the kernels, for messages."""

_PACKAGE = Path(__file__).resolve().parents[1]
WHEEL_LIBRARY = _PACKAGE / "lib" / kernel_build.LIBRARY
"""Where a binary wheel puts the library."""

_HERE = Path(__file__).resolve()
CHECKOUT_SOURCES = _HERE.parents[min(5, len(_HERE.parents) - 1)] / "csrc"
"""The sources of a checkout (``packages/lmcache-core/src/lmcache/gpu_ops`` is five below)."""

_OPS = ("gather_kv", "scatter_kv", "checksum_chunks")
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


@dataclass(frozen=True)
class CextStatus:
    """What :func:`load` did.

    Attributes:
        loaded: The ``torch.ops.lmcache`` CUDA ops are registered in this process.
        mode: ``"wheel"``, ``"jit"`` (built now), ``"jit-cached"`` (an earlier build),
            ``"already-registered"``, ``"disabled"``, ``"unavailable"`` or ``"not-tried"``.
        detail: Where the library was loaded from, or why none was.
        seconds: Time the load (and build) took.
        archs: The GPU code the loaded library holds (``sm_90``, ``compute_120``, ...).
    """

    loaded: bool
    mode: str
    detail: str
    seconds: float = 0.0
    archs: tuple[str, ...] = ()


_LOCK = threading.Lock()
_STATUS: CextStatus | None = None


def _flag(name: str) -> str:
    return os.environ.get(name, "").strip().lower()


def disabled() -> bool:
    """Whether ``LMCACHE_DISABLE_CEXT`` is set to a true value."""
    return _flag(DISABLE_ENV) in _TRUE


def required() -> bool:
    """Whether ``LMCACHE_REQUIRE_CEXT`` is set to a true value."""
    return _flag(REQUIRE_ENV) in _TRUE


def _from_checkout() -> bool:
    return (CHECKOUT_SOURCES / "torch_bindings.cpp").exists() and not (_PACKAGE / "csrc").exists()


def sources_dir() -> Path:
    """The kernel sources: the checkout's ``csrc/``, else the copy a wheel ships."""
    return CHECKOUT_SOURCES if _from_checkout() else _PACKAGE / "csrc"


def _jit_wanted() -> bool:
    value = _flag(JIT_ENV)
    if value in _TRUE:
        return True
    return value not in _FALSE and _from_checkout()


def wheel_build_info() -> dict[str, Any] | None:
    """The wheel library's ``build_info.json`` (archs, CUDA, torch ABI), or ``None``."""
    path = WHEEL_LIBRARY.parent / kernel_build.BUILD_INFO
    if not WHEEL_LIBRARY.exists() or not path.exists():
        return None
    info: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return info


def covers(archs: tuple[str, ...] | list[str], capability: tuple[int, int]) -> bool:
    """Whether code built for ``archs`` runs on a GPU of ``capability``.

    Machine code ``sm_XY`` runs on ``X.Y'`` with ``Y' >= Y`` (same major); PTX ``compute_XY``
    is compiled by the driver for any GPU of ``X.Y`` or newer.
    """
    major, minor = capability
    for arch in archs:
        kind, _, number = arch.partition("_")
        digits = number.rstrip("af")
        if len(digits) < 2 or not digits.isdigit():
            continue
        a_major, a_minor = int(digits[:-1]), int(digits[-1])
        if kind == "sm" and a_major == major and a_minor <= minor and number == digits:
            return True
        if kind == "compute" and (a_major, a_minor) <= (major, minor) and number == digits:
            return True
    return False


def cache_dir(archs: str) -> Path:
    """Folder of a JIT build for these sources, torch and architectures (the library has no
    Python ABI: every Python shares it)."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lmcache"
    key = "|".join(
        [
            kernel_build.sources_hash(sources_dir()),
            torch.__version__,
            archs,
        ]
    )
    return root / f"kernels-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def status() -> CextStatus:
    """What :func:`load` did, without loading (``mode="not-tried"`` before the first load)."""
    return _STATUS or CextStatus(False, "not-tried", "load() has not run in this process")


def load() -> CextStatus:
    """Load the kernels once (thread-safe); later calls return the first result.

    Returns:
        The :class:`CextStatus`.

    Raises:
        CextUnavailableError: ``LMCACHE_REQUIRE_CEXT=1`` and the kernels cannot be loaded (or
            ``LMCACHE_DISABLE_CEXT=1`` is set too).
    """
    global _STATUS
    with _LOCK:
        if _STATUS is None:
            _STATUS = _load()
            _log(_STATUS)
        result = _STATUS
    if not result.loaded and required():
        raise CextUnavailableError(
            f"{REQUIRE_ENV}=1 but lmcache's CUDA kernels are not loaded: {result.detail}. "
            f"Fix: {FIX}; or unset {REQUIRE_ENV} to use the no-binary implementation."
        )
    return result


def _log(result: CextStatus) -> None:
    if result.loaded:
        archs = ", ".join(result.archs) if result.archs else "unknown architectures"
        logger.info(
            "lmcache: CUDA kernels loaded (%s: %s; %s) in %.2f s",
            result.mode,
            result.detail,
            archs,
            result.seconds,
        )
    else:
        logger.info("lmcache: CUDA kernels not loaded (%s): %s", result.mode, result.detail)


def _ops_registered() -> bool:
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key("lmcache::gather_kv", "CUDA"))
    except RuntimeError:  # no such op
        return False


def _load() -> CextStatus:
    if disabled():
        why = f"{DISABLE_ENV}=1 is set"
        if required():
            why += f" together with {REQUIRE_ENV}=1 (they contradict each other: unset one)"
        return CextStatus(False, "disabled", why)
    if _ops_registered():
        return CextStatus(True, "already-registered", "another copy registered torch.ops.lmcache")
    missing = _device_missing()
    if missing:
        return CextStatus(False, "unavailable", missing)
    if _jit_wanted():
        return _load_jit()
    return _load_wheel()


def _device_missing() -> str:
    """Why no CUDA kernel can run here ("" when one can)."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is not a CUDA build"
    from lmcache.devices import get_backend

    if not get_backend("cuda").is_available():
        return "no CUDA device is visible"
    return ""


def _capabilities() -> set[tuple[int, int]]:
    from lmcache.devices.cuda import CudaBackend

    return CudaBackend().capabilities()


def _load_wheel() -> CextStatus:
    info = wheel_build_info()
    if info is None:
        return CextStatus(
            False,
            "unavailable",
            f"this lmcache-core has no compiled kernels ({WHEEL_LIBRARY} absent)",
        )
    archs = tuple(str(a) for a in info.get("archs", ()))
    uncovered = sorted(c for c in _capabilities() if not covers(archs, c))
    if uncovered:
        names = ", ".join(f"sm_{a}{b}" for a, b in uncovered)
        return CextStatus(
            False,
            "unavailable",
            f"the wheel's kernels hold no code for this GPU ({names}; built for {', '.join(archs)})",
        )
    from lmcache.devices.cuda import CudaBackend

    needed = _cuda_number(str(info.get("cuda", "0")))
    driver = CudaBackend().driver_version()
    if driver and driver < needed:
        return CextStatus(
            False,
            "unavailable",
            f"the NVIDIA driver runs CUDA up to {driver // 1000}.{driver % 1000 // 10}; the "
            f"wheel's kernels need CUDA {info.get('cuda')} (update the driver)",
        )
    start = time.perf_counter()
    try:
        _load_library(WHEEL_LIBRARY)
    except (OSError, RuntimeError) as exc:
        return CextStatus(False, "unavailable", f"loading {WHEEL_LIBRARY} failed: {exc}")
    _register_fakes()
    return CextStatus(True, "wheel", str(WHEEL_LIBRARY), time.perf_counter() - start, archs)


def _cuda_number(version: str) -> int:
    major, _, minor = version.partition(".")
    try:
        return int(major) * 1000 + int(minor or 0) * 10
    except ValueError:
        return 0


def _jit_archs() -> str:
    """The visible GPUs' architectures, ``"9.0;12.0"`` form."""
    return ";".join(f"{a}.{b}" for a, b in sorted(_capabilities()))


def _load_jit() -> CextStatus:
    start = time.perf_counter()
    toolkit, missing = kernel_build.find_toolkit()
    why_jit = f"{JIT_ENV}=1" if _flag(JIT_ENV) in _TRUE else "a source checkout"
    if toolkit is None:
        return CextStatus(
            False, "unavailable", f"{why_jit} asks for a JIT build, but {'; '.join(missing)}"
        )
    archs = _jit_archs()
    folder = cache_dir(archs)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        folder.chmod(0o700)
    library = folder / kernel_build.LIBRARY
    mode = "jit-cached"
    # Tensor-parallel ranks start together: one builds, the others wait for its library.
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not library.exists():
            mode = "jit"
            root = Path(torch.__file__).resolve().parent
            work = folder / f"build-{os.getpid()}"
            try:
                built = kernel_build.build(
                    sources_dir(),
                    work,
                    archs,
                    root / "include",
                    root / "lib",
                    toolkit,
                    log=logger.debug,
                )
            except (RuntimeError, OSError, ValueError) as exc:
                why = f"the JIT build in {work} failed: {str(exc).strip()[-2000:]}"
                return CextStatus(False, "unavailable", why)
            os.replace(built.parent / kernel_build.BUILD_INFO, folder / kernel_build.BUILD_INFO)
            os.replace(built, library)
    info = json.loads((folder / kernel_build.BUILD_INFO).read_text(encoding="utf-8"))
    try:
        _load_library(library)
    except (OSError, RuntimeError) as exc:
        return CextStatus(False, "unavailable", f"loading {library} failed: {exc}")
    _register_fakes()
    seconds = time.perf_counter() - start
    return CextStatus(True, mode, f"{library} ({why_jit})", seconds, tuple(info.get("archs", ())))


def _load_library(path: Path) -> None:
    torch.ops.load_library(str(path))  # type: ignore[no-untyped-call]


def _no_outputs(*args: object, **kwargs: object) -> None:
    """Fake (meta) implementation of the ops: they only write their mutable arguments."""
    return None


def _register_fakes() -> None:
    """Shape functions for the ops (``torch.library.opcheck``, ``torch.compile``)."""
    for op in _OPS:
        with contextlib.suppress(RuntimeError):  # already registered (a second load path)
            torch.library.register_fake(f"lmcache::{op}")(_no_outputs)
