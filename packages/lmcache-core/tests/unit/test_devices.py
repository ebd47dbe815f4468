# SPDX-License-Identifier: Apache-2.0
"""lmcache.devices: the registry, the CPU backend, and the recording stand-in (no GPU here:
the CUDA backend's bytes are checked in tests/gpu/test_devices_cuda.py)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lmcache._install_hint import adapter_install_command
from lmcache.devices import DeviceBackend, get_backend, register_backend, registered_backends
from lmcache.devices import registry as device_registry
from lmcache.devices.cpu import CpuBackend
from lmcache.gpu_connector.gpu_ops import lmcache_memcpy_async_d2h, lmcache_memcpy_async_h2d
from lmcache.memory import HostMemoryPool
from lmcache.testing.recording_backend import RecordedEvent, RecordedStream, RecordingBackend


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A private copy of the backend registry (tests may register and clobber)."""
    monkeypatch.setattr(device_registry, "_BACKENDS", dict(device_registry._BACKENDS))
    monkeypatch.setattr(device_registry, "_PLUGINS_TRIED", set())
    yield


def test_builtin_backends_by_device() -> None:
    cpu = get_backend("cpu")
    assert isinstance(cpu, CpuBackend) and cpu is get_backend(torch.device("cpu"))
    cuda = get_backend(torch.device("cuda", 1))
    assert cuda.device_type == "cuda" and cuda is get_backend("cuda:0")
    assert cuda.has_streams and not cpu.has_streams
    assert {"cpu", "cuda"} <= set(registered_backends())


def test_unknown_device_names_device_registered_and_package(registry: None) -> None:
    with pytest.raises(ValueError) as err:
        get_backend("nosuchdev:3")
    message = str(err.value)
    assert "'nosuchdev:3'" in message and "device type 'nosuchdev'" in message
    assert "Registered: ['cpu', 'cuda']" in message
    assert adapter_install_command("nosuchdev") in message


def test_register_backend_rejects_duplicates(registry: None) -> None:
    rec = RecordingBackend("xpu")
    register_backend(rec)
    register_backend(rec)  # the same object again: a no-op
    assert get_backend("xpu:0") is rec
    with pytest.raises(ValueError, match=r"already registered.*clobber=True"):
        register_backend(RecordingBackend("xpu"))
    other = RecordingBackend("xpu")
    register_backend(other, clobber=True)
    assert get_backend("xpu") is other


def test_device_package_registers_through_entry_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, registry: None
) -> None:
    info = tmp_path / "lmc_fake_xpu-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lmc-fake-xpu\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[lmcache.devices]\nfakexpu = lmc_fake_xpu:register\n")
    (tmp_path / "lmc_fake_xpu.py").write_text(
        "from lmcache.devices import register_backend\n"
        "from lmcache.testing.recording_backend import RecordingBackend\n"
        "def register():\n"
        "    register_backend(RecordingBackend('fakexpu'))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "lmc_fake_xpu", raising=False)
    assert "fakexpu" not in registered_backends()
    backend = get_backend("fakexpu:0")
    assert isinstance(backend, RecordingBackend) and backend.device_type == "fakexpu"
    sys.modules.pop("lmc_fake_xpu", None)


def test_cpu_backend_is_synchronous() -> None:
    cpu = get_backend("cpu")
    dev = torch.device("cpu")
    assert cpu.current_stream(dev) is None and cpu.new_stream(dev) is None
    event = cpu.event_after(None, blocking=True)
    assert cpu.event_query(event)
    cpu.event_synchronize(event)
    cpu.synchronize()
    with cpu.use_stream(None):
        pass
    pinned = cpu.pinned_empty(3 * 4096 + 5)
    assert pinned.dtype == torch.uint8 and pinned.numel() == 3 * 4096 + 5
    src = torch.randn(7, 9)
    dst = torch.zeros(7, 9)
    cpu.copy(dst, src)
    assert torch.equal(dst, src)
    raw = torch.zeros(7 * 9 * 4, dtype=torch.uint8)
    cpu.copy(raw, src)  # another dtype: the bytes, never a conversion
    assert torch.equal(raw.view(torch.float32).view(7, 9), src)
    with pytest.raises(ValueError, match="same byte size"):
        cpu.copy(torch.zeros(3), torch.zeros(4))


def _rows_copy(backend: DeviceBackend) -> None:
    src = torch.arange(100, dtype=torch.uint8)
    dst = torch.zeros(60, dtype=torch.uint8)
    backend.copy_2d(dst, 20, src, 30, 8, 3, backend.current_stream(torch.device("cpu")))
    expect = torch.zeros(60, dtype=torch.uint8)
    for i in range(3):
        expect[i * 20 : i * 20 + 8] = src[i * 30 : i * 30 + 8]
    assert torch.equal(dst, expect)


def test_copy_2d_moves_rows_at_both_pitches() -> None:
    _rows_copy(get_backend("cpu"))  # the row-by-row default
    _rows_copy(RecordingBackend("xpu"))


def test_copy_batch_moves_every_pair() -> None:
    for backend in (get_backend("cpu"), RecordingBackend("xpu")):
        srcs = [torch.randn(n) for n in (3, 17, 1)]
        dsts = [torch.zeros(n) for n in (3, 17, 1)]
        backend.copy_batch(dsts, srcs)
        assert all(torch.equal(d, s) for d, s in zip(dsts, srcs, strict=True))
        with pytest.raises(ValueError, match="2 destinations but 1 sources"):
            backend.copy_batch(dsts[:2], srcs[:1])


def test_recording_backend_records_streams_events_and_copies() -> None:
    rec = RecordingBackend("xpu", num_devices=2)
    assert rec.device_for_rank(3) == torch.device("xpu", 1)
    dev = rec.device_for_rank(1)
    main = rec.current_stream(dev)
    load = rec.new_stream(dev)
    assert isinstance(main, RecordedStream) and main is rec.current_stream(dev)
    assert load is not main and str(load.device) == "xpu:1"
    rec.wait_stream(load, main)
    with rec.use_stream(load):
        assert rec.current_stream(dev) is load
        dst, src = torch.zeros(4), torch.randn(4)
        rec.copy_h2d(dst, src, load)
        done = rec.event_after(load, blocking=True)
    assert rec.current_stream(dev) is main
    rec.wait_event(main, done)
    rec.event_synchronize(done)
    rec.stream_synchronize(load)
    assert torch.equal(dst, src)
    assert isinstance(done, RecordedEvent) and done.stream is load and done.blocking
    assert done.waited_by == [main]
    assert rec.names() == [
        "new_stream",
        "wait_stream",
        "use_stream",
        "copy",
        "new_event",
        "record_event",
        "wait_event",
        "event_synchronize",
        "synchronize",
    ]
    assert {c.device for c in rec.calls if c.name != "new_event"} == {"xpu:1"}
    assert rec.of("copy")[0].detail == (16, load)


def test_gpu_ops_copies_go_through_the_backend(registry: None) -> None:
    rec = RecordingBackend("cpu")  # stands in for a device whose tensors live on the CPU
    register_backend(rec, clobber=True)
    stream = rec.new_stream(torch.device("cpu"))
    src, dst = torch.randn(5), torch.zeros(5)
    lmcache_memcpy_async_h2d(dst, src, stream)
    lmcache_memcpy_async_d2h(src, dst)
    assert torch.equal(dst, src)
    assert [c.name for c in rec.calls] == ["new_stream", "copy", "record_stream", "copy"]


def test_host_pool_pins_exact_slab_sizes_through_the_backend() -> None:
    rec = RecordingBackend("xpu")
    budget = 3 * (1 << 20) + (1 << 19)  # the last slab is not a power of two
    pool = HostMemoryPool(budget, slab_bytes=1 << 20, backend=rec)
    assert pool.wait_prepinned(30)
    sizes = [c.detail[0] for c in rec.of("pinned_empty")]
    assert sizes == [1 << 20] * 3 + [1 << 19]
    unpinned = HostMemoryPool(budget, pin=False, backend=rec)
    with unpinned.allocate((4,), torch.float32):
        pass
    assert len(rec.of("pinned_empty")) == 4
