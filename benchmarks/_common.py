# SPDX-License-Identifier: Apache-2.0
"""Timing helpers shared by the benchmarks: host wall time and CUDA-event device time.

Every figure is a median after warm-up. ``wall_ms`` is what a caller of a blocking call waits
(the device synchronized before and after each call); ``event_ms`` is device time between two
CUDA events around ``inner`` back-to-back launches, divided by ``inner``, so that a copy shorter
than a launch's host overhead is still timed by the device and not by the host. Without CUDA
both fall back to ``time.perf_counter`` (the benchmarks' CPU smoke modes).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def sync(device: torch.device) -> None:
    """Wait for all work queued on ``device`` (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_ms(
    device: torch.device,
    fn: Callable[[], object],
    reps: int,
    warmup: int = 3,
    setup: Callable[[], object] | None = None,
) -> list[float]:
    """Host milliseconds of each of ``reps`` calls of ``fn`` after ``warmup`` untimed ones.

    ``setup`` runs before every call, outside the timed span (e.g. emptying a cache so that
    each store stores again).
    """
    times = []
    for i in range(warmup + reps):
        if setup is not None:
            setup()
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return times


def event_ms(
    device: torch.device,
    fn: Callable[[], object],
    reps: int,
    warmup: int = 3,
    inner: int = 1,
) -> list[float]:
    """Device milliseconds per call of ``fn``: events around ``inner`` back-to-back calls."""
    if device.type != "cuda":
        return [t / inner for t in wall_ms(device, lambda: [fn() for _ in range(inner)], reps)]
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return times


def median(xs: list[float]) -> float:
    """The median, ``nan`` for no samples."""
    return statistics.median(xs) if xs else float("nan")


def gbs(nbytes: int, ms: float) -> float:
    """GB/s (10^9 bytes per second) of ``nbytes`` moved in ``ms`` milliseconds."""
    return nbytes / ms / 1e6 if ms > 0 else float("nan")
