# SPDX-License-Identifier: Apache-2.0
"""The XPU backend over the ``torch.xpu`` stand-in: what it calls for streams, events, copies,
synchronisation and host memory; the store and load paths of the vLLM and SGLang connectors
through ``vllm.xpu`` / ``sglang.xpu``; the rank helpers; the unknown-device error."""

from __future__ import annotations

import importlib
import logging
import sys
import types

import pytest
import torch

from lmcache.config import LMCacheConfig
from lmcache.devices import get_backend, registry
from lmcache.gpu_connector import CreateGPUConnector, EngineInfo
from lmcache.gpu_connector.interface import ChunkTransfer, TransferSpec
from lmcache.testing.conformance import default_metadata_cases
from lmcache_xpu.device import XpuBackend
from lmcache_xpu.testing import FakeXpu

MD = next(m for m in default_metadata_cases() if not m.use_mla and m.kv_dtype == torch.float32)
BLOCK = 4


def _vllm_engine() -> tuple[EngineInfo, torch.Tensor]:
    c = MD.head_size_k + MD.head_size_v
    phys = torch.randn(MD.num_layers, 8, MD.num_kv_heads, BLOCK, c)
    return EngineInfo(
        "vllm", "xpu", [phys[i] for i in range(MD.num_layers)], {"block_size": 4}
    ), phys


def _sglang_engine() -> tuple[EngineInfo, torch.Tensor]:
    kv = torch.randn(2, MD.num_layers, 32, MD.num_kv_heads, MD.head_size_k)
    caches = [(kv[0, i], kv[1, i]) for i in range(MD.num_layers)]
    return EngineInfo("sglang", "xpu", caches), kv


# -- the backend itself -----------------------------------------------------------------------


def test_streams_events_copies_and_syncs_reach_torch_xpu(xpu: FakeXpu) -> None:
    backend = get_backend("xpu:0")
    assert isinstance(backend, XpuBackend) and backend.xpu is xpu
    dev = torch.device("xpu", 0)
    load = backend.new_stream(dev)
    src, dst = torch.randn(16), torch.zeros(16)
    with backend.use_stream(load):
        backend.copy(dst, src, load)
    ev = backend.event_after(load)
    backend.wait_event(backend.current_stream(dev), ev)
    backend.event_synchronize(ev)
    backend.synchronize(dev)
    assert torch.equal(dst, src)
    assert xpu.names() == [
        "Stream",
        "stream",
        "stream",
        "copy",
        "Event",
        "Event.record",
        "Stream.wait_event",
        "Event.synchronize",
        "synchronize",
    ]
    assert {c.device for c in xpu.calls if c.name != "Event"} == {"xpu:0"}
    assert xpu.of("copy")[0].detail == (64, load, True)  # non_blocking, on the load stream


def test_device_for_rank_follows_the_local_rank() -> None:
    backend = XpuBackend(FakeXpu(num_devices=4))
    assert [str(backend.device_for_rank(r)) for r in range(5)] == [
        "xpu:0",
        "xpu:1",
        "xpu:2",
        "xpu:3",
        "xpu:0",
    ]
    with pytest.raises(RuntimeError, match="needs a xpu device"):
        XpuBackend(FakeXpu(num_devices=0)).device_for_rank(0)


def test_a_foreign_device_is_refused() -> None:
    with pytest.raises(ValueError, match="XpuBackend got device 'cuda:0'"):
        XpuBackend(FakeXpu()).new_stream(torch.device("cuda", 0))


def test_no_pinned_memory_is_one_clear_log_line(caplog: pytest.LogCaptureFixture) -> None:
    """This CPU-only torch has no pinned allocator: plain memory, and the log says so once."""
    backend = XpuBackend(FakeXpu())
    with caplog.at_level(logging.WARNING, logger="lmcache_xpu.device"):
        a, b = backend.pinned_empty(100), backend.pinned_empty(7)
    assert (a.numel(), a.dtype, b.numel()) == (100, torch.uint8, 7)
    assert not backend.is_pinned(a)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "offers no pinned host memory for XPU" in lines[0], lines


def test_pinned_memory_where_torch_offers_it(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[bool] = []
    empty = torch.empty

    def fake_empty(*args, pin_memory=False, **kwargs):  # type: ignore[no-untyped-def]
        asked.append(pin_memory)
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", fake_empty)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
    backend = XpuBackend(FakeXpu())
    assert backend.pinned_empty(32).numel() == 32
    assert asked == [True, True]  # the probe, then the buffer


# -- the connectors' store and load through the *.xpu keys ------------------------------------


@pytest.mark.parametrize("make", [_vllm_engine, _sglang_engine], ids=["vllm", "sglang"])
def test_store_and_load_run_on_the_xpu_streams(xpu: FakeXpu, make) -> None:  # type: ignore[no-untyped-def]
    engine, kv = make()
    hints = {"kv_format": "kv_concat"} if engine.name == "vllm" else None
    conn = CreateGPUConnector(LMCacheConfig(), MD, engine, hints)
    public = importlib.import_module(f"lmcache_{engine.name}.gpu_connector")
    assert type(conn) in vars(public).values()  # the same class as the *.cuda key's
    backend = conn.backend
    assert isinstance(backend, XpuBackend) and backend.xpu is xpu
    store, load = backend.new_stream(conn.device), backend.new_stream(conn.device)
    n = 8
    buf = torch.zeros(MD.num_layers, n, conn.kv_width)
    slots = torch.arange(BLOCK, BLOCK + n)
    conn.from_gpu([ChunkTransfer(0, n, buf)], TransferSpec(slots, stream=store))
    stored = kv.clone()
    kv.zero_()
    xpu.clear()
    conn.to_gpu([ChunkTransfer(0, n, buf)], TransferSpec(slots, stream=load))
    conn.synchronize()  # what the engine calls before a load returns
    moved = kv != 0
    assert moved.any() and torch.equal(kv[moved], stored[moved])  # the moved slots came back
    # the load: ordered after the current stream, enqueued on the load stream, waited for
    calls = xpu.calls
    assert calls[0].name == "Stream.wait_stream" and calls[0].detail[0] is load
    entered = [c.detail[0] for c in xpu.of("stream")]
    assert entered and all(s is load for s in entered)
    assert calls[-1].name == "Stream.synchronize" and calls[-1].detail == (load,)
    assert {c.device for c in calls if c.name != "Event"} == {"xpu:0"}


def test_store_is_ordered_after_the_engine_and_enqueued_on_the_store_stream(
    xpu: FakeXpu,
) -> None:
    engine, _ = _vllm_engine()
    conn = CreateGPUConnector(LMCacheConfig(), MD, engine, {"kv_format": "kv_concat"})
    store = conn.backend.new_stream(conn.device)
    xpu.clear()
    buf = torch.zeros(MD.num_layers, 8, conn.kv_width)
    conn.from_gpu([ChunkTransfer(0, 8, buf)], TransferSpec(torch.arange(4, 12), stream=store))
    waits = xpu.of("Stream.wait_stream")
    assert waits and waits[0].detail[0] is store  # after the engine's writes
    assert xpu.of("copy") and all(c.detail[1] is store for c in xpu.of("copy"))
    assert buf.abs().sum() > 0  # the bytes (their layout: the conformance suite)


# -- rank helpers ------------------------------------------------------------------------------


def _vllm_config(**parallel: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(parallel_config=types.SimpleNamespace(**parallel))


@pytest.mark.parametrize(
    ("parallel", "local_rank", "local_world", "device"),
    [
        ({"tensor_parallel_size": 4, "rank": 3}, 3, 4, "xpu:3"),
        # 2 nodes, TP 4 x PP 2: a pipeline stage per node; global rank 6 is local rank 2
        ({"tensor_parallel_size": 4, "pipeline_parallel_size": 2, "rank": 6, "nnodes": 2}, 2, 4,
         "xpu:2"),
        # 2 nodes, DP 4 with 2 replicas per node, TP 2: replica 1 on its node starts at 2
        ({"tensor_parallel_size": 2, "rank": 1, "nnodes": 2, "data_parallel_size": 4,
          "data_parallel_size_local": 2, "data_parallel_rank_local": 1}, 3, 4, "xpu:3"),
    ],
)  # fmt: skip
def test_vllm_rank_helpers_give_the_xpu_of_each_rank(
    xpu: FakeXpu, monkeypatch: pytest.MonkeyPatch, parallel, local_rank, local_world, device
) -> None:  # type: ignore[no-untyped-def]
    from lmcache_vllm import utils

    xpu.num_devices = 4
    assert utils.calculate_local_rank_and_world_size(_vllm_config(**parallel)) == (
        local_rank,
        local_world,
    )
    # Without vLLM's platform (here a CPU build of vLLM may be installed: hide it), torch decides.
    monkeypatch.setitem(sys.modules, "vllm.platforms", None)
    kind, module = utils.get_vllm_torch_dev()
    assert kind == "xpu" and module is torch.xpu
    assert str(get_backend(kind).device_for_rank(local_rank)) == device


def test_get_vllm_torch_dev_asks_vllms_platform_first(monkeypatch: pytest.MonkeyPatch) -> None:
    from lmcache_vllm import utils

    platform = types.SimpleNamespace(
        is_cuda_alike=lambda: False, is_xpu=lambda: True, is_cpu=lambda: False
    )
    monkeypatch.setitem(
        __import__("sys").modules,
        "vllm.platforms",
        types.SimpleNamespace(current_platform=platform),
    )
    assert utils.get_vllm_torch_dev() == ("xpu", torch.xpu)


# -- errors ------------------------------------------------------------------------------------


def test_unknown_device_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """No backend for ``xpu`` (package not installed): the connector fails at construction,
    naming the device and the package, never at a later synchronize."""
    monkeypatch.setenv("LMCACHE_PLUGIN_AUTOLOAD", "0")
    monkeypatch.setattr(registry, "_BACKENDS", {})
    monkeypatch.setattr(registry, "_PLUGINS_TRIED", set())
    with pytest.raises(ValueError) as err:
        get_backend("xpu:1")
    msg = str(err.value)
    assert "No device backend for 'xpu:1'" in msg
    assert "lmcache_xpu-0.1.0-py3-none-any.whl" in msg
    # a connector over tensors of a device type nobody serves (meta stands in for one)
    caches = [torch.empty(8, MD.num_kv_heads, BLOCK, 16, device="meta")] * MD.num_layers
    from lmcache_vllm.gpu_connector import VLLMPagedConnector

    with pytest.raises(ValueError, match="No device backend for 'meta'"):
        VLLMPagedConnector(
            LMCacheConfig(), MD, EngineInfo("vllm", "xpu", caches, {"block_size": 4}),
            {"kv_format": "kv_concat"},
        )  # fmt: skip


def test_missing_adapter_names_its_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from lmcache_xpu import connectors

    monkeypatch.setitem(sys.modules, "lmcache_sglang.gpu_connector", None)
    engine, _ = _sglang_engine()
    with pytest.raises(ImportError, match=r"lmcache_sglang-0\.1\.0-py3-none-any\.whl"):
        connectors.select_sglang(LMCacheConfig(), MD, engine, None)
