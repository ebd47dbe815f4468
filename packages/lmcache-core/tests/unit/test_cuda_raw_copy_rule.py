# SPDX-License-Identifier: Apache-2.0
"""Which pairs the CUDA backend copies with a raw runtime call, checked without a GPU.

Only contiguous pairs with one side on the device and the host side page-locked qualify;
pageable memory takes torch's copy. The page-lock answer (a driver query) is asked once per
host storage, not once per copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from lmcache.devices import cuda
from lmcache.devices.cuda import _raw_ok


@pytest.fixture(autouse=True)
def _fresh_answers(monkeypatch) -> None:
    monkeypatch.setattr(cuda, "_PINNED", {})


@dataclass
class _Storage:
    ptr: int
    size: int = 1 << 20

    def data_ptr(self) -> int:
        return self.ptr

    def nbytes(self) -> int:
        return self.size


@dataclass
class _T:
    """The few tensor methods ``_raw_ok`` reads."""

    is_cuda: bool
    pinned: bool = False
    contiguous: bool = True
    storage: _Storage = field(default_factory=lambda: _Storage(0))
    asked: list[int] = field(default_factory=list)

    def is_contiguous(self) -> bool:
        return self.contiguous

    def is_pinned(self) -> bool:
        self.asked.append(1)
        return self.pinned

    def untyped_storage(self) -> _Storage:
        return self.storage


def test_which_pairs_qualify() -> None:
    dev = _T(is_cuda=True)
    pinned = lambda: _T(is_cuda=False, pinned=True, storage=_Storage(1 << 12))  # noqa: E731
    assert _raw_ok(dev, pinned())  # type: ignore[arg-type]
    assert _raw_ok(pinned(), dev)  # type: ignore[arg-type]
    assert not _raw_ok(dev, _T(is_cuda=False, pinned=False, storage=_Storage(2 << 12)))  # type: ignore[arg-type]
    assert not _raw_ok(pinned(), pinned())  # type: ignore[arg-type]
    assert _raw_ok(dev, _T(is_cuda=True))  # type: ignore[arg-type]
    assert not _raw_ok(dev, _T(is_cuda=False, pinned=True, contiguous=False))  # type: ignore[arg-type]


def test_the_driver_is_asked_once_per_host_storage() -> None:
    """Copies from one pool slab ask once; another storage (or the same address with another
    size: a new allocation) asks again."""
    dev = _T(is_cuda=True)
    slab = _Storage(4096)
    pieces = [_T(is_cuda=False, pinned=True, storage=slab) for _ in range(5)]
    other = _T(is_cuda=False, pinned=False, storage=_Storage(8192))
    regrown = _T(is_cuda=False, pinned=False, storage=_Storage(4096, 1 << 30))
    assert all(_raw_ok(dev, p) for p in pieces)  # type: ignore[arg-type]
    assert all(_raw_ok(p, dev) for p in pieces)  # type: ignore[arg-type]
    assert not _raw_ok(dev, other)  # type: ignore[arg-type]
    assert not _raw_ok(dev, regrown)  # type: ignore[arg-type]
    assert sum(len(p.asked) for p in pieces) == 1
    assert len(other.asked) == len(regrown.asked) == 1
