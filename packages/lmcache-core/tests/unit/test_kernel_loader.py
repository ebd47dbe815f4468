# SPDX-License-Identifier: Apache-2.0
"""Where the kernel sources live, how the build names architectures, and which library the loader
picks (in order, one per process), on the CPU: the decisions are taken before anything loads."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache.gpu_ops import _cext, kernel_build

ROOT = Path(__file__).resolve().parents[4]
CORE = ROOT / "packages" / "lmcache-core"


def test_one_copy_of_the_sources_in_the_root_csrc() -> None:
    csrc = ROOT / "csrc"
    assert {p.name for p in csrc.iterdir()} == {
        *kernel_build.SOURCES,
        *kernel_build.HEADERS,
        "README.md",
    }
    assert _cext.sources_dir() == csrc  # this checkout's, not a copy
    copies = []
    for folder, dirs, files in os.walk(ROOT / "packages", followlinks=False):
        dirs[:] = [d for d in dirs if d not in (".nox", "build", "__pycache__")]
        copies += [f"{folder}/{f}" for f in files if f.endswith((".cu", ".cuh", ".cpp", ".h"))]
    assert copies == []
    link = CORE / "csrc"  # what setup.py and the sdist read
    assert link.is_symlink() and link.resolve() == csrc
    assert "graft csrc" in (CORE / "MANIFEST.in").read_text()
    assert len(kernel_build.sources_hash(csrc)) == 16


def test_gencode_flags() -> None:
    flags, names = kernel_build.gencode_flags("8.0; 9.0 12.0+PTX")
    assert flags == [
        "-gencode=arch=compute_80,code=[sm_80]",
        "-gencode=arch=compute_90,code=[sm_90]",
        "-gencode=arch=compute_120,code=[sm_120,compute_120]",
    ]
    assert names == ["sm_80", "sm_90", "sm_120", "compute_120"]
    _, default = kernel_build.gencode_flags(kernel_build.DEFAULT_ARCHS)
    assert {"sm_80", "sm_89", "sm_90", "sm_100", "sm_120", "compute_120"} <= set(default)
    for bad in ("", "sm_90", "9", "9.0+ptx"):
        with pytest.raises(ValueError, match="LMCACHE_CUDA_ARCHS"):
            kernel_build.gencode_flags(bad)


@pytest.mark.parametrize(
    ("archs", "cc", "runs"),
    [
        (["sm_90"], (9, 0), True),
        (["sm_80"], (8, 6), True),  # same major, newer minor: the machine code runs
        (["sm_80"], (8, 0), True),
        (["sm_86"], (8, 0), False),  # older minor: it does not
        (["sm_80", "sm_90"], (10, 0), False),  # another major needs its own code or PTX
        (["sm_90", "compute_90"], (10, 0), True),  # PTX: the driver compiles it
        (["compute_120"], (9, 0), False),  # PTX runs only on its own or newer GPUs
        (["sm_90a"], (9, 0), False),  # arch-specific code is not portable code
        ([], (9, 0), False),
    ],
)
def test_covers(archs: list[str], cc: tuple[int, int], runs: bool) -> None:
    assert _cext.covers(archs, cc) is runs


@pytest.fixture
def loader(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    """A fresh loader state on a pretend CUDA machine; records every library load."""
    for var in ("LMCACHE_JIT", "LMCACHE_DISABLE_CEXT", "LMCACHE_REQUIRE_CEXT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(_cext, "_STATUS", None)
    monkeypatch.setattr(_cext, "_device_missing", lambda: "")
    monkeypatch.setattr(_cext, "_capabilities", lambda: {(9, 0)})
    monkeypatch.setattr(_cext, "_ops_registered", lambda: False)
    monkeypatch.setattr(_cext, "_register_fakes", lambda: None)
    loads: list[str] = []
    monkeypatch.setattr(torch.ops, "load_library", loads.append)
    lib = tmp_path / "lib" / kernel_build.LIBRARY
    monkeypatch.setattr(_cext, "WHEEL_LIBRARY", lib)
    return {"loads": loads, "lib": lib}


def _wheel(lib: Path, archs: list[str], cuda: str = "13.0") -> None:
    lib.parent.mkdir(parents=True, exist_ok=True)
    lib.write_bytes(b"\x7fELF")
    info = {"archs": archs, "cuda": cuda, "torch_abi": "2.11"}
    (lib.parent / kernel_build.BUILD_INFO).write_text(json.dumps(info))


def test_a_checkout_builds_from_its_sources_unless_told_not_to(
    loader: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[Path] = []
    monkeypatch.setattr(
        _cext,
        "_load_jit",
        lambda: built.append(_cext.sources_dir()) or _cext.CextStatus(True, "jit", "x"),
    )
    assert _cext.load().mode == "jit" and built == [ROOT / "csrc"]
    monkeypatch.setattr(_cext, "_STATUS", None)
    monkeypatch.setenv("LMCACHE_JIT", "0")
    assert _cext.load().mode == "unavailable"  # no wheel library here, and JIT is off
    assert loader["loads"] == [] and len(built) == 1


def test_the_wheel_library_loads_once_when_it_covers_the_gpu(
    loader: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LMCACHE_JIT", "0")
    _wheel(loader["lib"], ["sm_80", "sm_90", "compute_90"])
    from lmcache.devices.cuda import CudaBackend

    monkeypatch.setattr(CudaBackend, "driver_version", lambda self: 13000)
    first = _cext.load()
    assert (first.loaded, first.mode, first.archs) == (
        True,
        "wheel",
        ("sm_80", "sm_90", "compute_90"),
    )
    assert _cext.load() is first
    assert loader["loads"] == [str(loader["lib"])]


@pytest.mark.parametrize(
    ("archs", "driver", "why"),
    [
        (["sm_80", "sm_100"], 13000, "hold no code for this GPU (sm_90"),
        (["sm_90"], 12080, "driver runs CUDA up to 12.8; the wheel's kernels need CUDA 13.0"),
    ],
)
def test_the_wheel_library_is_refused_before_loading(
    loader: dict[str, Any], monkeypatch: pytest.MonkeyPatch, archs: list[str], driver: int, why: str
) -> None:
    monkeypatch.setenv("LMCACHE_JIT", "0")
    _wheel(loader["lib"], archs)
    from lmcache.devices.cuda import CudaBackend

    monkeypatch.setattr(CudaBackend, "driver_version", lambda self: driver)
    result = _cext.load()
    assert not result.loaded and why in result.detail
    assert loader["loads"] == []


def test_ops_registered_by_another_copy_are_used_not_loaded_again(
    loader: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    _wheel(loader["lib"], ["sm_90"])
    monkeypatch.setattr(_cext, "_ops_registered", lambda: True)
    monkeypatch.setenv("LMCACHE_JIT", "1")
    result = _cext.load()
    assert (result.loaded, result.mode) == (True, "already-registered")
    assert loader["loads"] == []


def test_jit_without_a_toolkit_says_what_is_missing(
    loader: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LMCACHE_JIT", "1")
    monkeypatch.setattr(kernel_build, "find_toolkit", lambda: (None, ["no nvcc (set CUDA_HOME)"]))
    result = _cext.load()
    assert not result.loaded
    assert result.detail == "LMCACHE_JIT=1 asks for a JIT build, but no nvcc (set CUDA_HOME)"
    monkeypatch.setenv("LMCACHE_REQUIRE_CEXT", "1")
    with pytest.raises(_cext.CextUnavailableError, match="LMCACHE_JIT=1 with nvcc"):
        _cext.load()


def test_sources_use_only_torchs_stable_abi() -> None:
    """ATen, c10 or torch/library.h would tie the binary to the torch it was built against."""
    for name in (*kernel_build.SOURCES, *kernel_build.HEADERS):
        text = (ROOT / "csrc" / name).read_text()
        includes = [ln for ln in text.splitlines() if ln.startswith("#include <")]
        torch_includes = [i for i in includes if "torch/" in i or "ATen" in i or "c10/" in i]
        assert all("torch/csrc/stable/" in i or "torch/headeronly/" in i for i in torch_includes), (
            name,
            torch_includes,
        )
