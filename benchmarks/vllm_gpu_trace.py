# SPDX-License-Identifier: Apache-2.0
"""``vllm_gpu.py --gpu-trace``: where the GPU's time went, from a ``torch.profiler`` trace.

:func:`traced` runs a function under the profiler (CUDA activity only) and summarises the trace:
kernel time per stream, idle time by gap size and between which kernels, vLLM's own
device-to-host copies started late, and with :class:`~vllm_gpu_profile.Profile`'s host spans
which host work overlapped the GPU's waits.
"""

from __future__ import annotations

import itertools
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm_gpu_profile import Profile

_MARKER = "spin_kernel"  # torch.cuda._sleep's kernel: aligns the trace's clock with the host's


def _gpu_time(
    trace: Path,
    host0: float | None = None,
    spans: Sequence[tuple[str, str, float, float]] = (),
    timeline: bool = False,
) -> str:
    """Where the GPU's time went in a ``torch.profiler`` Chrome trace (CUDA activity): kernel
    time per stream (the busiest is vLLM's), idle time between kernels, copies per stream.

    With ``host0`` (``time.perf_counter()`` when the :data:`_MARKER` kernel was launched on an
    idle GPU) and ``spans`` (``(thread, what, start, end)`` host intervals), also which of them
    overlapped the GPU's waits over 0.1 ms (up to 5 ms, and longer), and with ``timeline`` one
    request's waits and host spans. Always: when vLLM's own device-to-host copies started late
    while a big copy on another stream ran.

    The marker aligns the clocks only roughly: on the first engine traced in a process the host
    spans were seen 10-45 ms off (vLLM's ``execute_model`` placed after the kernels it launched),
    so check a timeline against such landmarks before reading it."""
    import collections
    import json

    events = [
        e
        for e in json.loads(trace.read_text())["traceEvents"]
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy")
    ]
    markers = [e for e in events if _MARKER in e.get("name", "")]
    events = [e for e in events if _MARKER not in e.get("name", "")]
    kernels = sorted((e for e in events if e["cat"] == "kernel"), key=lambda e: e["ts"])
    if not kernels:
        return "no kernels traced"
    per: dict[tuple[str, Any], float] = collections.defaultdict(float)
    for e in events:
        per[(e["cat"], e.get("args", {}).get("stream"))] += e["dur"]
    main = max((k for k in per if k[0] == "kernel"), key=lambda k: per[k])
    idle = _idle_gaps(kernels)
    gaps = [hi - lo for lo, hi, _, _ in idle]
    waits = [(lo, hi) for lo, hi, _, _ in idle if hi - lo > 100]  # over 0.1 ms, trace us
    where: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for lo, hi, before, after in idle:
        if 100 < hi - lo <= 5000:  # inside a step: between which kernels
            cell = where[(_short(kernels[before]["name"]), _short(kernels[after]["name"]))]
            cell[0] += 1
            cell[1] += hi - lo
    bins = ((0, 100), (100, 1000), (1000, 5000), (5000, float("inf")))  # microseconds
    hist = ", ".join(
        f"{'>' if b == float('inf') else ''}{(a if b == float('inf') else b) / 1e3:g} ms: "
        f"{sum(1 for g in gaps if a < g <= b)} = "
        f"{sum(g for g in gaps if a < g <= b) / 1e3:.1f} ms"
        for a, b in bins
    )
    span = max(e["ts"] + e["dur"] for e in kernels) - kernels[0]["ts"]
    busy = span - sum(gaps)
    other = sum(v for k, v in per.items() if k[0] == "kernel" and k != main)
    copies = ", ".join(
        f"stream {k[1]} {v / 1e3:.1f} ms" for k, v in sorted(per.items()) if k[0] == "gpu_memcpy"
    )
    text = (
        f"span {span / 1e3:.1f} ms, kernels busy {busy / 1e3:.1f} ms (vLLM's stream "
        f"{per[main] / 1e3:.1f}, other streams {other / 1e3:.1f}), idle {(span - busy) / 1e3:.1f} "
        f"ms (gaps up to {hist}); copies: {copies}"
    )
    top = sorted(where.items(), key=lambda kv: -kv[1][1])[:5]
    text += "\n    gaps of 0.1-5 ms, after -> before kernel: " + "; ".join(
        f"{a} -> {b}: {n} = {t / 1e3:.1f} ms" for (a, b), (n, t) in top
    )
    if host0 is not None and markers:
        offset = markers[0]["ts"] - host0 * 1e6  # trace us = host s * 1e6 + offset
        if timeline:
            text += "\n    " + _timeline(kernels, offset, spans)
        small = [w for w in waits if w[1] - w[0] <= 5000]
        large = [w for w in waits if w[1] - w[0] > 5000]
        text += "\n    " + _attribute(small, offset, spans, "0.1-5 ms")
        text += "\n    " + _attribute(large, offset, spans, "over 5 ms")
    text += "\n    " + _copy_lag(events, main[1])
    return text


def _timeline(
    kernels: Sequence[dict[str, Any]],
    offset: float,
    spans: Sequence[tuple[str, str, float, float]],
) -> str:
    """One request (the third run of kernels between GPU waits over 5 ms) on one clock: its
    GPU waits over 0.1 ms and the host spans from 5 ms before its first kernel to its last."""
    bounds = [0] + [after for lo, hi, _, after in _idle_gaps(kernels) if hi - lo > 5000]
    runs = [kernels[a:b] for a, b in itertools.pairwise([*bounds, len(kernels)])]
    run = runs[min(2, len(runs) - 1)]
    t0 = run[0]["ts"]
    end = max(e["ts"] + e["dur"] for e in run)
    rows = [f"one request's GPU work ({len(runs)} runs, the 3rd): {(end - t0) / 1e3:.1f} ms"]
    for lo, hi, before, after in _idle_gaps(run):
        if hi - lo > 100:
            rows.append(
                f"  GPU idle +{(lo - t0) / 1e3:.2f} ms for {(hi - lo) / 1e3:.2f} ms: "
                f"{_short(run[before]['name'])} -> {_short(run[after]['name'])}"
            )
    for thread, what, a, b in sorted(spans, key=lambda sp: sp[2]):
        ta, tb = a * 1e6 + offset, b * 1e6 + offset
        if tb >= t0 - 5000 and ta <= end and tb - ta > 20:
            rows.append(
                f"  host {thread}: {what} +{(ta - t0) / 1e3:.2f} .. +{(tb - t0) / 1e3:.2f} ms"
            )
    return "\n    ".join(rows)


def _idle_gaps(kernels: Sequence[dict[str, Any]]) -> list[tuple[float, float, int, int]]:
    """``(start, end, index of the kernel before, index of the kernel after)`` of every time the
    GPU ran no kernel, on any stream, between ``kernels`` (sorted by start; trace
    microseconds)."""
    out = []
    hi, last = kernels[0]["ts"], 0
    for i, e in enumerate(kernels):  # the union of kernel intervals over every stream
        if e["ts"] > hi:
            out.append((hi, e["ts"], last, i))
        if e["ts"] + e["dur"] >= hi:
            hi, last = e["ts"] + e["dur"], i
    return out


def _short(name: str) -> str:
    """A kernel's name without its template arguments and parameters, at most 40 chars."""
    return name.split("<", 1)[0].split("(", 1)[0].rsplit("::", 1)[-1][:40]


def _attribute(
    waits: Sequence[tuple[float, float]],
    offset: float,
    spans: Sequence[tuple[str, str, float, float]],
    label: str,
) -> str:
    """Which host spans overlapped the GPU's waits (trace microseconds), most first (a hook
    called inside another, e.g. an in-process lookup inside ``get_num_new_matched_tokens``,
    counts in both)."""
    overlap: dict[tuple[str, str], float] = {}
    for lo, hi in waits:
        a, b = (lo - offset) / 1e6, (hi - offset) / 1e6
        for thread, what, start, end in spans:
            inside = min(end, b) - max(start, a)
            if inside > 0:
                overlap[(thread, what)] = overlap.get((thread, what), 0.0) + inside
    total = sum(hi - lo for lo, hi in waits) / 1e3
    top = sorted(overlap.items(), key=lambda kv: -kv[1])[:12]
    found = ", ".join(f"{thread}: {what} {1e3 * sec:.1f} ms" for (thread, what), sec in top)
    return f"GPU waits {label}: {len(waits)}, {total:.1f} ms; host work inside: {found or 'none'}"


def _copy_lag(events: Sequence[dict[str, Any]], main_stream: Any) -> str:
    """vLLM's own device-to-host copies (streams without a copy over 64 MiB): how late each
    started after the last kernel on vLLM's stream before it, and how many overlapped a copy
    of another stream over 64 MiB (lmcache's saves)."""
    import bisect

    copies = [e for e in events if e["cat"] == "gpu_memcpy" and "DtoH" in e.get("name", "")]
    big = [e for e in copies if int(e.get("args", {}).get("bytes", 0)) > 64 << 20]
    big_streams = {e.get("args", {}).get("stream") for e in big}
    own = [e for e in copies if e.get("args", {}).get("stream") not in big_streams]
    ends = sorted(
        e["ts"] + e["dur"]
        for e in events
        if e["cat"] == "kernel" and e.get("args", {}).get("stream") == main_stream
    )
    lags, during = [], 0
    for e in own:
        i = bisect.bisect_right(ends, e["ts"])
        if i:
            lags.append(e["ts"] - ends[i - 1])
        if any(b["ts"] < e["ts"] + e["dur"] and e["ts"] < b["ts"] + b["dur"] for b in big):
            during += 1
    if not lags:
        return "vLLM's device-to-host copies: none traced"
    lags.sort()
    return (
        f"vLLM's device-to-host copies: {len(own)}, {during} while a copy over 64 MiB ran; "
        f"start after vLLM's last kernel: median {lags[len(lags) // 2] / 1e3:.2f} ms, "
        f"max {lags[-1] / 1e3:.2f} ms, sum {sum(lags) / 1e3:.1f} ms"
    )


def traced(fn: Any, prof: Profile, timeline: bool = False) -> tuple[Any, str]:
    """``(fn(), _gpu_time of the GPU work while it ran)``, with ``prof.spans`` attributed."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as tracer:
        torch.cuda.synchronize()
        host0: float | None = time.perf_counter()
        try:
            torch.cuda._sleep(1000)  # type: ignore[no-untyped-call]  # the clock marker
        except (AttributeError, RuntimeError):  # no marker: no attribution
            host0 = None
        torch.cuda.synchronize()
        if prof.spans is not None:
            prof.spans.clear()
        out = fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        tracer.export_chrome_trace(str(path))
        return out, _gpu_time(path, host0, prof.spans or (), timeline)
