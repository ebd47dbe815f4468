# SPDX-License-Identifier: Apache-2.0
"""Host <-> device copies, device-op injection and device helpers."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache.config import LMCacheConfig
from lmcache.devices import registry as device_registry
from lmcache.gpu_connector import gpu_ops
from lmcache.gpu_connector.gpu_ops import (
    HostDeviceOps,
    get_device_ops,
    lmcache_memcpy_async_d2h,
    lmcache_memcpy_async_h2d,
    register_device_ops,
)
from lmcache.gpu_connector.utils import (
    current_stream_for,
    get_device_type,
    is_pinned_memory_available,
    need_gpu_interm_buffer,
)

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("copy", [lmcache_memcpy_async_h2d, lmcache_memcpy_async_d2h])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_cpu_copy_is_exact(copy: Any, dtype: torch.dtype) -> None:
    src = (torch.randn(3, 5, 7) * 50).to(dtype)
    dst = torch.zeros_like(src)
    copy(dst, src)
    assert torch.equal(dst, src)


def test_cpu_copy_into_non_contiguous_view() -> None:
    src = torch.randn(4, 6)
    big = torch.zeros(6, 8)
    dst = big[:, 2:6].t()  # [4, 6] non-contiguous
    lmcache_memcpy_async_h2d(dst, src)
    assert torch.equal(big[:, 2:6].t(), src)
    assert torch.equal(big[:, :2], torch.zeros(6, 2))


@pytest.mark.parametrize("copy", [lmcache_memcpy_async_h2d, lmcache_memcpy_async_d2h])
def test_shape_and_dtype_mismatch_rejected(copy: Any) -> None:
    dst = torch.zeros(2, 3)
    with pytest.raises(
        ValueError, match=r"same shape and dtype.*dst \[2, 3\] torch.float32 and src \[3, 2\]"
    ):
        copy(dst, torch.ones(3, 2))
    with pytest.raises(ValueError, match="float16"):
        copy(dst, torch.ones(2, 3, dtype=torch.float16))
    assert torch.equal(dst, torch.zeros(2, 3))


def test_unknown_device_type_names_registered_and_fix() -> None:
    with pytest.raises(ValueError, match=r"'nosuchdev'.*Registered: \['cpu', 'cuda'"):
        get_device_ops("nosuchdev")


@pytest.fixture
def fake_device_ops() -> Iterator[list[tuple[str, Any]]]:
    calls: list[tuple[str, Any]] = []

    def h2d(dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        calls.append(("h2d", stream))
        dst.copy_(src)

    def d2h(dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        calls.append(("d2h", stream))
        dst.copy_(src)

    # Stand in for a device package by swapping the cpu entry (the only device present here).
    original = get_device_ops("cpu")
    ops = HostDeviceOps("cpu", h2d, d2h, lambda device: "stream0", lambda stream: None)
    register_device_ops("cpu", ops, clobber=True)
    yield calls
    register_device_ops("cpu", original, clobber=True)


def test_injected_ops_receive_the_copies(fake_device_ops: list[tuple[str, Any]]) -> None:
    src = torch.randn(4)
    dst = torch.zeros(4)
    lmcache_memcpy_async_h2d(dst, src, stream="s1")
    lmcache_memcpy_async_d2h(src, dst, stream="s2")
    assert fake_device_ops == [("h2d", "s1"), ("d2h", "s2")]
    assert torch.equal(dst, src)
    assert current_stream_for("cpu") == "stream0"


def test_register_device_ops_rejects_duplicates_and_mismatch() -> None:
    cpu = get_device_ops("cpu")
    with pytest.raises(ValueError, match="already registered"):
        register_device_ops(
            "cpu", HostDeviceOps("cpu", cpu.h2d, cpu.d2h, cpu.current_stream, cpu.synchronize)
        )
    register_device_ops("cpu", cpu)  # the same object again is a no-op
    assert get_device_ops("cpu") is cpu
    with pytest.raises(ValueError, match="must match"):
        register_device_ops("xpu", cpu)
    assert "xpu" not in gpu_ops.registered_device_types()


def test_utils() -> None:
    assert need_gpu_interm_buffer(LMCacheConfig(gpu_staging_buffer=True)) is True
    assert need_gpu_interm_buffer(LMCacheConfig(gpu_staging_buffer=False)) is False
    assert get_device_type(torch.zeros(1)) == "cpu"
    assert current_stream_for(torch.device("cpu")) is None
    assert is_pinned_memory_available() == torch.cuda.is_available()


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("use_stream", [False, True])
def test_cuda_round_trip_on_stream(use_stream: bool) -> None:
    host = torch.randn(64, 129).pin_memory()
    dev = torch.empty(64, 129, device="cuda")
    back = torch.empty_like(host).pin_memory()
    stream = torch.cuda.Stream() if use_stream else None
    lmcache_memcpy_async_h2d(dev, host, stream)
    lmcache_memcpy_async_d2h(back, dev, stream)
    get_device_ops("cuda").synchronize(stream)
    assert torch.equal(back, host)
    assert current_stream_for("cuda") == torch.cuda.current_stream()


@pytest.mark.gpu
@requires_cuda
def test_cuda_direction_checked() -> None:
    dev = torch.zeros(4, device="cuda")
    with pytest.raises(ValueError, match="src must be a host"):
        lmcache_memcpy_async_h2d(torch.zeros(4, device="cuda"), dev)
    with pytest.raises(ValueError, match="dst must be a host"):
        lmcache_memcpy_async_d2h(dev, torch.zeros(4, device="cuda"))


def test_device_plugin_entry_point_loaded_on_first_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    info = tmp_path / "lmc_fake_dev-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lmc-fake-dev\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[lmcache.devices]\nfakedev = lmc_fake_dev:register\n")
    (tmp_path / "lmc_fake_dev.py").write_text(
        "from lmcache.gpu_connector.gpu_ops import HostDeviceOps, get_device_ops, "
        "register_device_ops\n"
        "def register():\n"
        "    cpu = get_device_ops('cpu')\n"
        "    register_device_ops('fakedev', HostDeviceOps('fakedev', cpu.h2d, cpu.d2h, "
        "cpu.current_stream, cpu.synchronize))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "lmc_fake_dev", raising=False)
    monkeypatch.setattr(device_registry, "_BACKENDS", dict(device_registry._BACKENDS))
    monkeypatch.setattr(device_registry, "_PLUGINS_TRIED", set())
    assert "fakedev" not in gpu_ops.registered_device_types()
    assert get_device_ops("fakedev").device_type == "fakedev"
    assert "fakedev" in gpu_ops.registered_device_types()
    sys.modules.pop("lmc_fake_dev", None)


def test_device_plugins_off_with_autoload_zero(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LMCACHE_PLUGIN_AUTOLOAD", "0")
    monkeypatch.setattr(device_registry, "_PLUGINS_TRIED", set())
    with pytest.raises(ValueError, match="No device backend for 'fakedev2'"):
        get_device_ops("fakedev2")
