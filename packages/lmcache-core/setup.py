# SPDX-License-Identifier: Apache-2.0
"""lmcache-core's build: pyproject.toml holds the metadata; this file adds the kernels.

Every build ships the kernel sources as ``lmcache/csrc/`` (a JIT build can use them with
``LMCACHE_JIT=1``). With ``LMCACHE_BUILD_KERNELS=1`` the build also compiles them into
``lmcache/lib/liblmcache_kernels.so`` (``lmcache/gpu_ops/kernel_build.py``) and tags the wheel
for Linux x86-64, Python-independent (``py3-none-manylinux_2_N_x86_64``). That build needs torch
(>= 2.11, any build: only its headers and ``libtorch_cpu.so`` are used) and a CUDA toolkit
(CUDA_HOME, nvcc on PATH, or the registry's ``nvidia-cuda-nvcc`` + ``nvidia-cuda-runtime``) in
the build environment, hence ``pip wheel --no-build-isolation``. ``LMCACHE_CUDA_ARCHS`` picks the
architectures (default in kernel_build.DEFAULT_ARCHS). ``nox -s build`` does all of this.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
CSRC = HERE / "csrc"  # a link to the repository's csrc/ in a checkout, a folder in the sdist


def _kernel_build():  # type: ignore[no-untyped-def]
    """lmcache/gpu_ops/kernel_build.py, loaded by path (lmcache is not installed yet)."""
    name = "lmcache_kernel_build"
    if name in sys.modules:
        return sys.modules[name]
    path = HERE / "src" / "lmcache" / "gpu_ops" / "kernel_build.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _want_kernels() -> bool:
    value = os.environ.get("LMCACHE_BUILD_KERNELS", "0").strip().lower()
    if value not in {"0", "1", "true", "false", "yes", "no", "on", "off", ""}:
        raise SystemExit(f"LMCACHE_BUILD_KERNELS: expected 1 or 0, found {value!r}")
    return value in {"1", "true", "yes", "on"}


class BuildPy(build_py):
    """Copies the kernel sources into the package; compiles them when asked."""

    def run(self) -> None:
        super().run()
        if not (CSRC / "torch_bindings.cpp").exists():
            raise SystemExit(f"lmcache-core: kernel sources not found in {CSRC}")
        kb = _kernel_build()
        target = Path(self.build_lib) / "lmcache" / "csrc"
        target.mkdir(parents=True, exist_ok=True)
        for name in (*kb.SOURCES, *kb.HEADERS):
            shutil.copyfile(CSRC / name, target / name)
        if _want_kernels():
            self._compile(kb, Path(self.build_lib) / "lmcache" / "lib")

    def _compile(self, kb, out: Path) -> None:  # type: ignore[no-untyped-def]
        try:
            import torch
        except ImportError as exc:
            raise SystemExit(
                "LMCACHE_BUILD_KERNELS=1 needs torch in the build environment "
                f"(pip wheel --no-build-isolation): {exc}"
            ) from exc
        toolkit, missing = kb.find_toolkit()
        if toolkit is None:
            raise SystemExit("LMCACHE_BUILD_KERNELS=1 but no CUDA toolkit: " + "; ".join(missing))
        archs = os.environ.get("LMCACHE_CUDA_ARCHS") or kb.DEFAULT_ARCHS
        root = Path(torch.__file__).resolve().parent
        objects = Path(self.get_finalized_command("build").build_temp) / "kernels"
        library = kb.build(CSRC, objects, archs, root / "include", root / "lib", toolkit)
        out.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(library, out / kb.LIBRARY)
        shutil.copyfile(library.parent / kb.BUILD_INFO, out / kb.BUILD_INFO)
        print(f"lmcache-core: kernels for {archs} (CUDA {toolkit.version}) in {out / kb.LIBRARY}")


class BinaryDistribution(Distribution):
    """With the compiled library the distribution is platform-specific (files go to platlib)."""

    def has_ext_modules(self) -> bool:
        return _want_kernels()


class BdistWheel(bdist_wheel):
    """A wheel with the compiled library is ``py3-none-manylinux_2_N_x86_64``: no Python ABI."""

    def get_tag(self) -> tuple[str, str, str]:
        if not _want_kernels():
            return super().get_tag()
        kb = _kernel_build()
        library = Path(self.bdist_dir or "", "lmcache", "lib", kb.LIBRARY)
        major, minor = kb.glibc_needed(library) if library.exists() else (2, 34)
        return "py3", "none", f"manylinux_{major}_{minor}_x86_64"


setup(distclass=BinaryDistribution, cmdclass={"build_py": BuildPy, "bdist_wheel": BdistWheel})
