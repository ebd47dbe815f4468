# SPDX-License-Identifier: Apache-2.0
"""Compiles ``csrc/`` into ``liblmcache_kernels.so``: the wheel build and the JIT build share it.

The library holds the ``torch.ops.lmcache`` CUDA ops on torch's stable ABI (``torch/csrc/stable``,
built for the 2.11 ABI with ``TORCH_TARGET_VERSION``), so one file loads with every torch from
2.11 on. It links the CUDA runtime statically (it needs only the NVIDIA driver, whatever CUDA
torch was built with) and ``libtorch_cpu.so`` (the stable C shim, already loaded by torch).

This module imports nothing but the standard library: ``setup.py`` loads it by path before
lmcache is installed. Steps, in order: find the toolkit (:func:`find_toolkit`), compile each
``.cu`` with nvcc and each ``.cpp`` with the host compiler, link, then write
``build_info.json`` beside the library (what :mod:`lmcache.gpu_ops._cext` reads before loading).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BUILD_INFO",
    "DEFAULT_ARCHS",
    "HEADERS",
    "LIBRARY",
    "SOURCES",
    "TORCH_ABI",
    "Toolkit",
    "build",
    "find_toolkit",
    "gencode_flags",
    "glibc_needed",
    "sources_hash",
]

SOURCES = ("torch_bindings.cpp", "kv_ops.cpp", "kv_gather.cu", "kv_scatter.cu", "checksum.cu")
"""Translation units of the library."""

HEADERS = ("ops.h", "kv_copy_params.h", "kv_copy.cuh", "checksum.cuh")

LIBRARY = "liblmcache_kernels.so"
BUILD_INFO = "build_info.json"

DEFAULT_ARCHS = "7.5;8.0;8.6;8.9;9.0;10.0;12.0+PTX"
"""Architectures of the wheel (``LMCACHE_CUDA_ARCHS``): machine code for each, and PTX for the
newest, which the driver compiles for a GPU newer than every listed one."""

TORCH_ABI = (2, 11)
"""The oldest torch whose stable ABI the library is built for (``TORCH_TARGET_VERSION``)."""


@dataclass(frozen=True)
class Toolkit:
    """A CUDA toolkit that can build the library.

    Attributes:
        nvcc: The ``nvcc`` executable.
        include: Folder holding ``cuda_runtime_api.h``.
        cudart_static: ``libcudart_static.a``.
        cxx: The host C++ compiler.
        version: nvcc's ``release X.Y``.
    """

    nvcc: Path
    include: Path
    cudart_static: Path
    cxx: str
    version: str


def sources_hash(folder: Path) -> str:
    """SHA-256 (hex, first 16 digits) of the sources and headers in ``folder``."""
    h = hashlib.sha256()
    for name in sorted(SOURCES + HEADERS):
        h.update(name.encode() + b"\0" + (folder / name).read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _toolkit_roots() -> list[Path]:
    """Where a toolkit may be: ``CUDA_HOME``/``CUDA_PATH``, ``nvcc`` on ``PATH``, then the
    registry's ``nvidia-cuda-nvcc`` wheel (``nvidia/cu13``) on ``sys.path``."""
    roots = [Path(os.environ[v]) for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    on_path = shutil.which("nvcc")
    if on_path:
        roots.append(Path(on_path).resolve().parent.parent)
    for entry in sys.path:
        roots.extend(sorted(Path(entry or ".").glob("nvidia/cu1[3-9]"), reverse=True))
    return roots


def _first(root: Path, *relative: str) -> Path | None:
    for rel in relative:
        if (root / rel).exists():
            return root / rel
    return None


def find_toolkit() -> tuple[Toolkit | None, list[str]]:
    """The first complete toolkit, or ``None`` with what each candidate lacked."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    missing: list[str] = []
    if cxx is None:
        missing.append("no host C++ compiler (g++ or c++ on PATH, or CXX)")
    roots = _toolkit_roots()
    if not roots:
        missing.append(
            "no nvcc (set CUDA_HOME, put nvcc on PATH, or pip install nvidia-cuda-nvcc "
            "nvidia-cuda-runtime)"
        )
    for root in roots:
        nvcc = _first(root, "bin/nvcc")
        include = _first(
            root, "include/cuda_runtime_api.h", "targets/x86_64-linux/include/cuda_runtime_api.h"
        )
        static = _first(
            root,
            "lib64/libcudart_static.a",
            "lib/libcudart_static.a",
            "targets/x86_64-linux/lib/libcudart_static.a",
        )
        if nvcc is None or include is None or static is None:
            lacks = [
                n
                for n, p in (
                    ("bin/nvcc", nvcc),
                    ("cuda_runtime_api.h", include),
                    ("libcudart_static.a", static),
                )
                if p is None
            ]
            missing.append(f"{root}: no {', '.join(lacks)}")
            continue
        if cxx is None:
            return None, missing
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=False)
        found = re.search(r"release (\d+\.\d+)", out.stdout)
        return Toolkit(nvcc, include.parent, static, cxx, found.group(1) if found else "?"), []
    return None, missing


def gencode_flags(archs: str) -> tuple[list[str], list[str]]:
    """nvcc ``-gencode`` flags and the names compiled in, from ``"8.0;9.0+PTX"`` (``TORCH_CUDA_ARCH_LIST`` form).

    Raises:
        ValueError: an entry is not ``MAJOR.MINOR`` with an optional ``+PTX``.
    """
    flags: list[str] = []
    names: list[str] = []
    for entry in filter(None, (e.strip() for e in re.split(r"[;\s,]+", archs))):
        found = re.fullmatch(r"(\d+)\.(\d+)(a|f)?(\+PTX)?", entry)
        if found is None:
            raise ValueError(
                f"LMCACHE_CUDA_ARCHS: expected entries like 9.0 or 12.0+PTX, found {entry!r} in "
                f"{archs!r}"
            )
        cc = f"{found.group(1)}{found.group(2)}{found.group(3) or ''}"
        codes = [f"sm_{cc}"] + ([f"compute_{cc}"] if found.group(4) else [])
        flags.append(f"-gencode=arch=compute_{cc},code=[{','.join(codes)}]")
        names.extend(codes)
    if not flags:
        raise ValueError(f"LMCACHE_CUDA_ARCHS: expected at least one architecture, found {archs!r}")
    return flags, names


def glibc_needed(library: Path) -> tuple[int, int]:
    """The newest ``GLIBC_2.N`` symbol version ``library`` asks for (its manylinux floor)."""
    versions = [int(m) for m in re.findall(rb"GLIBC_2\.(\d+)", library.read_bytes())]
    return (2, max(versions, default=17))


def build(
    sources: Path,
    out_dir: Path,
    archs: str,
    torch_include: Path,
    torch_lib: Path,
    toolkit: Toolkit,
    log: Callable[[str], None] = print,
    jobs: int | None = None,
) -> Path:
    """Compile and link the library into ``out_dir``; write its ``build_info.json``.

    Args:
        sources: Folder holding :data:`SOURCES` and :data:`HEADERS` (``csrc/``).
        out_dir: Where the library, its objects and ``build_info.json`` go.
        archs: ``"8.0;9.0+PTX"``-style architecture list.
        torch_include: torch's ``include`` folder (only the stable headers are used).
        torch_lib: torch's ``lib`` folder (``libtorch_cpu.so``).
        toolkit: From :func:`find_toolkit`.
        log: Receives one line per step.
        jobs: Compiler processes at once (default: the CPU count).

    Returns:
        The library's path.

    Raises:
        RuntimeError: a compiler or the linker failed (its output is in the message).
    """
    gencode, names = gencode_flags(archs)
    out_dir.mkdir(parents=True, exist_ok=True)
    abi = f"-DTORCH_TARGET_VERSION=0x{TORCH_ABI[0]:02x}{TORCH_ABI[1]:02x}000000000000"
    common = [
        "-std=c++17",
        "-O3",
        abi,
        f"-I{sources}",
        f"-I{torch_include}",
        f"-I{toolkit.include}",
    ]
    commands = []
    for name in SOURCES:
        obj = out_dir / (name + ".o")
        if name.endswith(".cu"):
            cmd = [
                str(toolkit.nvcc),
                *common,
                "-Xcompiler",
                "-fPIC",
                f"-ccbin={toolkit.cxx}",
                *gencode,
                "-c",
                str(sources / name),
                "-o",
                str(obj),
            ]
        else:
            cmd = [
                toolkit.cxx,
                *common,
                "-fPIC",
                "-fvisibility=hidden",
                "-c",
                str(sources / name),
                "-o",
                str(obj),
            ]
        commands.append((name, cmd, obj))

    def run(name: str, cmd: list[str]) -> None:
        log(f"lmcache kernels: compiling {name}")
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(
                f"compiling {name} failed:\n{' '.join(cmd)}\n{done.stdout}{done.stderr}"
            )

    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        for future in [pool.submit(run, name, cmd) for name, cmd, _ in commands]:
            future.result()
    library = out_dir / LIBRARY
    link = [
        toolkit.cxx,
        "-shared",
        "-o",
        str(library),
        *[str(o) for _, _, o in commands],
        str(toolkit.cudart_static),
        "-ldl",
        "-lrt",
        "-lpthread",
        f"-L{torch_lib}",
        "-ltorch_cpu",
        "-Wl,--no-undefined",
        "-Wl,--as-needed",
    ]
    log(f"lmcache kernels: linking {library.name}")
    done = subprocess.run(link, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"linking failed:\n{' '.join(link)}\n{done.stdout}{done.stderr}")
    info = {
        "sources_hash": sources_hash(sources),
        "archs": names,
        "cuda": toolkit.version,
        "torch_abi": ".".join(map(str, TORCH_ABI)),
        "glibc": ".".join(map(str, glibc_needed(library))),
    }
    (out_dir / BUILD_INFO).write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
    return library
