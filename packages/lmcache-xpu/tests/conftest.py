# SPDX-License-Identifier: Apache-2.0
"""Fixtures of the lmcache-xpu tests: the ``torch.xpu`` stand-in forced in, and a guard that
fails a test when anything calls into ``torch.cuda``."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from lmcache_xpu.testing import FakeXpu, fake_xpu

PACKAGES = Path(__file__).resolve().parents[2]

# every torch.cuda function a backend or connector would call to use a CUDA device
CUDA_FUNCTIONS = (
    "Stream",
    "Event",
    "current_stream",
    "stream",
    "synchronize",
    "set_device",
    "empty_cache",
    "device_count",
    "current_device",
)


def load_test_module(package: str, name: str) -> ModuleType:
    """An adapter's test module by path (each package's ``tests`` is its own ``tests``)."""
    path = PACKAGES / package / "tests" / "unit" / f"{name}.py"
    key = f"_xpu_reuse_{package.replace('-', '_')}_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, path)
        assert spec is not None and spec.loader is not None, path
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


@pytest.fixture
def cuda_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of ``torch.cuda`` functions called during the test (``is_available`` answers
    ``False`` and is recorded as ``"is_available"``; any other is recorded and raises)."""
    calls: list[str] = []

    def forbid(name: str):  # type: ignore[no-untyped-def]
        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls.append(name)
            raise AssertionError(f"torch.cuda.{name} was called on the XPU path")

        return call

    for name in CUDA_FUNCTIONS:
        original = getattr(torch.cuda, name)
        if isinstance(original, type):  # a class stays a class (annotations use `Stream | None`)
            guarded = type(name, (original,), {"__new__": staticmethod(forbid(name))})
            monkeypatch.setattr(torch.cuda, name, guarded)
        else:
            monkeypatch.setattr(torch.cuda, name, forbid(name))

    def is_available() -> bool:
        calls.append("is_available")
        return False

    monkeypatch.setattr(torch.cuda, "is_available", is_available)
    return calls


@pytest.fixture
def xpu(cuda_calls: list[str]) -> Iterator[FakeXpu]:
    """The XPU backend over a :class:`FakeXpu`, serving ``xpu`` and the CPU tensors; fails the
    test if a CUDA function other than the ``is_available`` probe was called."""
    with fake_xpu() as fake:
        yield fake
    assert set(cuda_calls) <= {"is_available"}, cuda_calls


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "xpu: needs an Intel GPU (skips with a reason elsewhere)")
