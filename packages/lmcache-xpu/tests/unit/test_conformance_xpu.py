# SPDX-License-Identifier: Apache-2.0
"""Core's connector conformance suite, the vLLM and SGLang connector suites, through the
``vllm.xpu`` and ``sglang.xpu`` keys and the XPU backend over the ``torch.xpu`` stand-in.

Every class of the adapters' own conformance modules runs again with ``EngineInfo(device="xpu")``
(so ``CreateGPUConnector`` looks up ``<engine>.xpu``); the KV tensors are CPU tensors, served by
the XPU backend (:func:`lmcache_xpu.testing.fake_xpu`). After each test the recorded calls must
show the XPU backend at work on ``xpu:0`` (except vLLM's CPU-attention formats, which never
reach a device), and no CUDA function may have been called. The suite passes no stream (the
current one), where the SGLang connector's copies are plain torch ops on the device tensors and
need no backend call; ``test_xpu_paths`` drives both with the store and load streams.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from lmcache_xpu.testing import FakeXpu

from ..conftest import load_test_module

_VLLM = load_test_module("lmcache-vllm", "test_gpu_connector_conformance")
_SGLANG = load_test_module("lmcache-sglang", "test_gpu_connector_conformance")


# vLLM's CPU-attention block formats: on CPU tensors they take the host block path, which
# copies between host buffers directly (no device, no backend call); an XPU cache never has them
HOST_ONLY_FORMATS = ("cpu_kt_v", "cpu_amx")


@pytest.fixture(autouse=True)
def _through_xpu(request: pytest.FixtureRequest, xpu: FakeXpu) -> Iterator[None]:
    yield
    assert {c.device for c in xpu.calls} <= {"xpu:0", ""}, {c.device for c in xpu.calls}
    if getattr(request.cls, "kv_format", None) in HOST_ONLY_FORMATS:
        return
    if request.node.name.startswith("test_bad_chunk_buffer_rejected"):
        return  # rejected before any transfer: nothing reaches the device
    if request.cls.__name__.startswith("TestVllm"):
        # the vLLM connector stages through the backend even on the current stream
        assert xpu.of("stream"), "no work was enqueued on an XPU stream"


def _on_xpu(cls: type) -> type:
    """``cls`` with its engines reported on ``xpu`` (the suite's tests unchanged)."""

    def make_engine(self, metadata):  # type: ignore[no-untyped-def]
        return dataclasses.replace(cls.make_engine(self, metadata), device="xpu")

    return type(f"{cls.__name__}OnXpu", (cls,), {"make_engine": make_engine, "__test__": True})


for _module in (_VLLM, _SGLANG):
    for _name in dir(_module):
        _cls = getattr(_module, _name)
        if _name.startswith("Test") and isinstance(_cls, type):
            globals()[f"{_name}OnXpu"] = _on_xpu(_cls)
