# SPDX-License-Identifier: Apache-2.0
"""``sglang_gpu.py``'s engines, its table and its trace report.

:data:`ENGINES` names the engines one run can compare; :func:`print_table` prints their figures
side by side, each TTFT beside the physical bound measured in the same run;
:func:`print_trace` adds up, per engine and step, the calls SGLang made into its storage backend
or lmcache (``sglang_gpu_trace.py``) and compares the time inside them with the steps' wall time.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

import sglang_gpu_trace as trace

ENGINES: dict[str, tuple[str, dict[str, Any]]] = {
    "base": ("SGLang alone", {}),
    "host": ("HiCache host", {"hicache": ("page_first", "kernel")}),
    "file": ("HiCache+file", {"hicache": ("page_first", "kernel"), "storage": "file"}),
    "lmc-pf": (
        "HiC+lmc pf",
        {"hicache": ("page_first", "kernel"), "storage": "lmcache", "interface_v1": 1},
    ),
    "lmc-pf-nosum": (
        "lmc pf sum off",
        {
            "hicache": ("page_first", "kernel"),
            "storage": "lmcache",
            "interface_v1": 1,
            "checksum": False,
        },
    ),
    "lmc-pfd": (
        "HiC+lmc pfd",
        {"hicache": ("page_first_direct", "direct"), "storage": "lmcache", "interface_v1": 1},
    ),
    "lmc-lf": (
        "HiC+lmc lf",
        {"hicache": ("layer_first", "kernel"), "storage": "lmcache", "interface_v1": 0},
    ),
    "enable": ("enable-lmcache", {"enable_lmcache": True}),
}
"""Engine name: (column header, what it runs). ``hicache``: (host layout, I/O backend);
``storage``: HiCache's L3 (SGLang's ``file`` backend or lmcache's); ``interface_v1``: lmcache's
zero-copy interface (1) or flat pages (0); ``checksum``: lmcache's ``checksum`` key (its
default, on, when absent); ``enable_lmcache``: ``--enable-lmcache``."""

_W = 15


def _med(xs: list[float] | None, skip_first: bool = False) -> float:
    if not xs:
        return float("nan")
    return statistics.median(xs[1:] if skip_first and len(xs) > 2 else xs)


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{1e3 * x:.1f}"


def _row(label: str, cells: list[str], note: str = "") -> None:
    print(f"{label:<34}" + "".join(f"{c:>{_W}}" for c in cells) + (f"  {note}" if note else ""))


def _hit(res: dict[str, Any], label: str) -> str:
    hits = res.get("hits", {}).get(label) or []
    if not hits:
        return "-"
    h = hits[-1]
    parts = [f"{k[0]}{v}" for k, v in h.items() if k != "cached" and v]
    return "/".join(parts) or str(h.get("cached", 0))


def print_table(results: dict[str, dict[str, Any]], info: dict[str, Any]) -> None:
    """One column per engine: medians over the measured prompts, against the bound. Each
    engine's bound is the copy of the prompt's KV (``info["copy_s"]``) plus one decode step,
    that engine's own device hit: engines run one after the other, so another engine's figure
    would carry the machine's drift between them."""
    names = list(results)
    s = {e: results[e].get("samples", {}) for e in names}
    base = s.get("base")
    floor = {e: _med(s[e].get("floor")) for e in names}
    bound = {e: info["copy_s"] + floor[e] for e in names}
    print(f"\n=== {info['title']}")
    _row("", [ENGINES[e][0] for e in names])
    _row("engine start (s)", [f"{results[e].get('start_s', float('nan')):.0f}" for e in names])
    cold = {e: _med(s[e].get("cold")) for e in names}
    _row("cold TTFT (ms)", [_ms(cold[e]) for e in names])
    if base is not None:
        b = cold["base"]
        _row("  against SGLang alone", [f"{100 * (cold[e] / b - 1):+.1f} %" for e in names])
    _row("SGLang's own device hit (ms)", [_ms(floor[e]) for e in names], "(one decode step)")
    _row("bound (ms)", [_ms(bound[e]) for e in names], "(KV copy + that decode step)")
    l2 = {e: _med(s[e].get("l2")) for e in names}
    _row("HiCache host-tier hit (ms)", [_ms(l2[e]) for e in names], "after another prompt")
    _row("  tokens (d=device h=host s=storage)", [_hit(results[e], "l2") for e in names])
    _row(
        "  against the bound",
        [f"{l2[e] / bound[e]:.2f}x" if not math.isnan(l2[e]) else "-" for e in names],
    )
    _row("backup into storage (s)", [_sec(_med(s[e].get("backup"))) for e in names])
    _row("flush_cache() wait (s)", [_sec(_med(s[e].get("flush"))) for e in names])
    warm = {e: _med(s[e].get("warm")) for e in names}
    _row("TTFT after flush_cache() (ms)", [_ms(warm[e]) for e in names])
    _row("  tokens (d=device h=host s=storage)", [_hit(results[e], "warm") for e in names])
    _row(
        "  against the bound",
        [f"{warm[e] / bound[e]:.2f}x" for e in names],
        "(a recompute where nothing was restored)",
    )
    tput = {e: _med(s[e].get("tput")) for e in names}
    _row("throughput, 0 % reuse (tok/s)", [f"{tput[e]:.0f}" for e in names])
    if base is not None:
        b = tput["base"]
        _row("  against SGLang alone", [f"{100 * tput[e] / b:.1f} %" for e in names])
    _row(
        "greedy token as expected",
        [_same(results[e]) for e in names],
        "(host-tier hit, after flush: a restore = SGLang's own device hit, a recompute = cold)",
    )
    _row(
        "  SGLang's device hit = cold",
        [_floor(results[e]) for e in names],
        "(SGLang's own numerics: a 1-token extend over cached KV against a whole prefill)",
    )
    print(
        f"bound = KV {info['kv_bytes'] / 2**20:.0f} MiB / {info['bw_what']} "
        f"{info['kv_bytes'] / info['copy_s'] / 1e9:.1f} GB/s ({1e3 * info['copy_s']:.1f} ms, "
        "measured before the engines) + one decode step (the engine's own device hit of the "
        "same prompt)"
    )
    for e in names:
        for note in results[e].get("notes", []):
            print(f"  {e}: {note}")


def _same(res: dict[str, Any]) -> str:
    same, differs = len(res.get("same", [])), res.get("differs", [])
    return f"{same}/{same + len(differs)}" + (" DIFF" if differs else "")


def _floor(res: dict[str, Any]) -> str:
    differs = len(res.get("floor_differs", []))
    return f"{differs} differ" if differs else "all same"


def _sec(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2f}"


def print_trace(results: dict[str, dict[str, Any]], folder: Path, detail: bool) -> None:
    """Per engine and step (warm-up excluded): wall time, time inside the storage backend's or
    lmcache's hooks (pages per call), inner steps with ``detail``, SGLang's own storage steps."""
    for engine, res in results.items():
        events = trace.read(folder / engine / "trace")
        if not any("n" in e for e in events):
            continue
        print(f"\n--- trace: {engine} ({ENGINES[engine][0]})")
        by_step: dict[str, list[list[Any]]] = {}
        phases = res.get("phases", [])
        for i, (label, rep, t0, t1) in enumerate(phases):
            if rep == 0 and label != "tput":
                continue
            end = phases[i + 1][2] if i + 1 < len(phases) else t1 + 60.0
            by_step.setdefault(label, []).append([t0, t1, end])
        for label, spans in by_step.items():
            wall = sum(t1 - t0 for t0, t1, _ in spans)
            hooks: dict[str, list[float]] = {}
            inner: dict[str, list[float]] = {}
            sgl: dict[str, list[float]] = {}
            lead, tail = [], []
            for t0, t1, end in spans:
                got = trace.summary(events, t0, end)
                for src, dst in (
                    (got["hooks"], hooks),
                    (got["inner"], inner),
                    (got["sglang"], sgl),
                ):
                    for name, vals in src.items():
                        acc = dst.setdefault(name, [0.0] * len(vals))
                        for j, v in enumerate(vals):
                            acc[j] += v
                if not math.isnan(got["first"]):
                    lead.append(got["first"] - t0)
                    tail.append(t1 - got["last"])
            if not hooks and not sgl:
                continue
            inside = sum(v[2] for v in hooks.values())
            n = len(spans)
            line = f"  {label:<7} x{n}: wall {1e3 * wall / n:8.1f} ms, "
            line += f"in hooks {1e3 * inside / n:8.1f} ms"
            if lead:
                line += (
                    f" (first call {1e3 * statistics.median(lead):.1f} ms after the step began, "
                    f"step ended {1e3 * statistics.median(tail):.1f} ms after the last call)"
                )
            print(line)
            for name, (calls, pages, sec) in sorted(hooks.items(), key=lambda x: -x[1][2]):
                per = f", {pages / calls:.0f} pages/call" if pages else ""
                print(f"      {name:<34} {calls / n:6.1f} calls{per}, {1e3 * sec / n:8.2f} ms")
            if detail:
                for name, (sec, calls) in sorted(inner.items(), key=lambda x: -x[1][0]):
                    print(f"        . {name:<30} {calls / n:8.1f} calls, {1e3 * sec / n:8.2f} ms")
            for name, (calls, _, sec) in sorted(sgl.items(), key=lambda x: -x[1][2]):
                print(f"      [SGLang] {name:<25} {calls / n:6.1f} calls, {1e3 * sec / n:8.2f} ms")
