# SPDX-License-Identifier: Apache-2.0
"""Which pairs the CUDA backend copies with a raw runtime call, checked without a GPU.

Only contiguous pairs with one side on the device and the host side page-locked qualify;
pageable memory takes torch's copy. Within one batch the page-lock answer (a driver call) is
asked once per host storage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lmcache.devices.cuda import _raw_ok


@dataclass
class _Storage:
    ptr: int

    def data_ptr(self) -> int:
        return self.ptr


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
    assert _raw_ok(dev, _T(is_cuda=False, pinned=True))  # type: ignore[arg-type]
    assert _raw_ok(_T(is_cuda=False, pinned=True), dev)  # type: ignore[arg-type]
    assert not _raw_ok(dev, _T(is_cuda=False, pinned=False))  # type: ignore[arg-type]
    assert not _raw_ok(_T(is_cuda=False, pinned=True), _T(is_cuda=False, pinned=True))  # type: ignore[arg-type]
    assert _raw_ok(dev, _T(is_cuda=True))  # type: ignore[arg-type]
    assert not _raw_ok(dev, _T(is_cuda=False, pinned=True, contiguous=False))  # type: ignore[arg-type]


def test_a_batch_asks_once_per_host_storage() -> None:
    dev = _T(is_cuda=True)
    slab = _Storage(4096)
    pieces = [_T(is_cuda=False, pinned=True, storage=slab) for _ in range(5)]
    other = _T(is_cuda=False, pinned=False, storage=_Storage(8192))
    memo: dict[int, bool] = {}
    assert all(_raw_ok(dev, p, memo) for p in pieces)  # type: ignore[arg-type]
    assert not _raw_ok(dev, other, memo)  # type: ignore[arg-type]
    assert sum(len(p.asked) for p in pieces) == 1
    assert memo == {4096: True, 8192: False}
